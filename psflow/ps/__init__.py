"""The parameter server's engine: the variable store and its checkpoints.

Plain objects with no gRPC inside. ``python -m ps_server`` serves a
:class:`~psflow.ps.store.VariableStore` over gRPC; ParameterServerStrategy's
embedded mode uses one directly inside the chief.
"""
