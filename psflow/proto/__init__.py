"""Generated protobuf and gRPC modules for ``protos/psflow/v1/*.proto``.

The generated files are committed rather than built at install time, so that
installing psflow needs no protoc and every checkout imports the same code.
They are produced only by ``scripts/gen_protos.py`` (grpc_tools.protoc, imports
rewritten to be package-relative) and never edited by hand;
``tests/test_protos_fresh.py`` regenerates them into a temporary directory and
fails if the committed files differ.  Import the modules explicitly::

    from psflow.proto import ps_pb2, tensor_pb2
"""
