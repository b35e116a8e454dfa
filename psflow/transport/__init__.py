"""psflow's wire: tensor codec, chunk framing, channel options and the PS client.

* :mod:`.codec` — dtypes, shapes, raw little-endian bytes, ``np.frombuffer`` decoding.
* :mod:`.framing` — header + chunk messages built and split without protobuf copies.
* :mod:`.options` — explicit gRPC channel/server options and chunk sizes.
* :mod:`.service` — the ParameterServer methods, shared by client and server.
* :mod:`.client` — :class:`PSClient`.
* :mod:`.status` — a call's failure status as the typed psflow error (every client edge).
* :mod:`.dataplane` — the raw TCP data plane beside gRPC for push and pull payloads.

Importing this package imports neither gRPC nor the client; use
``from psflow.transport.client import PSClient``.
"""
