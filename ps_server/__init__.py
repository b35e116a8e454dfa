"""The psflow parameter-server process.

Modules (imported explicitly; this package imports nothing on its own):

* :mod:`ps_server.servicer` — the gRPC servicer translating RPCs to calls on a
  :class:`psflow.ps.store.VariableStore` (the plain variable store lives in
  ``psflow.ps`` so ParameterServerStrategy's embedded mode can use it too,
  with its checkpoints in ``psflow.ps.checkpoint``).
* :mod:`ps_server.server` — ``create_server(store, bind, port) -> (server, port)``
  and ``serve(...)``.
* ``python -m ps_server`` — the process entry point (see ``__main__``).
"""
