"""The psflow parameter-server process.

Modules (imported explicitly; this package imports nothing on its own):

* :mod:`ps_server.store` — :class:`~ps_server.store.VariableStore`, the plain
  variable store (no gRPC): create, pull, push through update rules, assign,
  exactly-once ids, synchronous steps, stats.
* :mod:`ps_server.checkpoint` — atomic save/restore of a shard (safetensors + manifest).
* :mod:`ps_server.servicer` — the gRPC servicer translating RPCs to store calls.
* :mod:`ps_server.server` — ``create_server(store, bind, port) -> (server, port)``
  and ``serve(...)``.
* ``python -m ps_server`` — the process entry point (see ``__main__``).
"""
