"""psflow's wire: tensor codec, chunk framing, channel options and the PS client.

* ``codec`` — :mod:`psflow.wire.codec` (dtypes, shapes, raw little-endian bytes),
  a layer below both this package and :mod:`psflow.ps`, named here as well.
* :mod:`.messages` — the PS message format: each encoder beside its decoder.
* :mod:`.started` — a call started without waiting for it; the one fan-out and its rule.
* :mod:`.core` — the client core both clients stand on: one PS task's endpoint
  (channel, retry policy, data-plane discovery, one attempt either way), request ids.
* :mod:`.framing` — header + chunk messages built and split without protobuf copies.
* :mod:`.options` — explicit gRPC channel/server options and chunk sizes.
* :mod:`.service` — the ParameterServer methods, shared by client and server.
* :mod:`.client` — :class:`PSClient`.
* :mod:`.status` — a call's failure status as the typed psflow error (every client edge).
* :mod:`.dataplane` — the raw TCP data plane beside gRPC for push and pull payloads.

Importing this package imports neither gRPC nor the client; use
``from psflow.transport.client import PSClient``.
"""

from psflow.wire import codec

__all__ = ["codec"]
