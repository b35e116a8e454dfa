"""Securing psflow's services: authentication, TLS and resource limits.

Modules (imported explicitly; nothing is read or started on import):

* :mod:`psflow.security.config` — ``SecurityConfig``: the shared token and
  mutual-TLS material, parsed once from arguments and ``PSFLOW_AUTH_TOKEN``,
  ``PSFLOW_AUTH_TOKEN_FILE``, ``PSFLOW_TLS_CERT/KEY/CA``; the rule that a
  server bound beyond loopback needs authentication (or ``--insecure``);
* :mod:`psflow.security.grpc_auth` — the server interceptor checking
  ``authorization: Bearer <token>`` in constant time (the health service is
  exempt), server and channel credentials;
* :mod:`psflow.security.probe` — tells a client rejected during the TLS
  handshake apart from an unreachable server;
* :mod:`psflow.security.limits` — tensor, variable, stream and closure limits
  (RESOURCE_EXHAUSTED naming the limit and the value);
* :mod:`psflow.security.flags` — the command-line flags of all of the above,
  shared by ``python -m ps_server`` and ``python -m worker``.

The embedded mode (everything in one process, no gRPC) needs none of this.
"""
