"""A raw TCP data plane beside gRPC's control plane: push and pull payloads over a socket.

grpcio's per-call and per-byte cost in Python bounds what a parameter server
can serve; this package moves the tensor payload of the hot calls to a plain
socket the server announces over gRPC, authenticated with the same token and
TLS material.  One concept per module:

* :mod:`.frames`: the fixed binary frame header and its limits;
* :mod:`.stream`: frames over one socket, read into caller buffers;
* :mod:`.auth`: the HELLO token check and the TLS contexts;
* :mod:`.door`: what a peer gets before it has authenticated;
* :mod:`.loop`: a welcomed connection's one request path, and the threads that wait for it;
* :mod:`.server`: :class:`DataPlaneServer`: accept, handshake, dispatch;
* :mod:`.client`: :class:`DataPlaneClient`, a pool of connections.
"""

from .client import DataPlaneClient, Sink
from .frames import FrameError
from .server import DataPlaneServer, Handler, Reply, Request, Route

__all__ = [
    "DataPlaneClient",
    "DataPlaneServer",
    "FrameError",
    "Handler",
    "Reply",
    "Request",
    "Route",
    "Sink",
]
