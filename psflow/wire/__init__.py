"""The wire's lowest layer: dtype and shape tables and tensor bytes (:mod:`.codec`).

Below both :mod:`psflow.ps` (the store checks specs with it) and
:mod:`psflow.transport` (the clients and the message format encode with it);
it imports neither.
"""
