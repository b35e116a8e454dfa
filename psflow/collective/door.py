"""An elastic worker's one listening port: ring links and re-form requests, by generation.

A worker of an elastic group keeps its ``TF_CONFIG`` port open for the whole
run (a fixed ring closes it once both links are up).  Every incoming
connection must authenticate first (the data plane's HELLO and token, TLS as
every port, at most :data:`HELLO_SECONDS` to say it), then names itself in
the HELLO's ``client``:

* ``worker:ID/gen:G``: the dialling side of a ring link of generation ``G``;
  kept until the :class:`~.peer_link.PeerLinks` of that generation takes it
  (:meth:`Door.take_ring`);
* ``join:ID/gen:G``: a member of generation ``G`` that lost its ring and asks
  to re-form; its one JSON request is queued for the membership agreement
  (:mod:`psflow.collective.membership`, :meth:`Door.take_joins`);
* ``probe:ID/gen:G``: answered (WELCOME, or the refusal below) and closed: a
  worker that finds nobody to follow asks whether the group went on without it;
* ``view:ID/gen:0``: answered with the door's generation, members and the
  group's address table (JSON), whatever the caller's generation: a starting
  worker asks whether a group already trains;
* ``admit:ID/gen:G``: a worker asking to join generation ``G`` at its next
  step boundary, its JSON request naming its own address (a worker beyond the
  group's ``TF_CONFIG`` list is known by it); queued (:meth:`Door.take_admits`)
  until the group's rank 0 answers it with the decision.

A connection of a generation older than the door's is refused with an ERROR
frame (ABORTED) saying so: a worker the group went on without learns it
instead of disturbing the new ring.  The door answers from its own threads,
so a worker busy computing still shows it is alive.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import ssl
import threading
import time
from typing import Any

from psflow import errors
from psflow.errors import Code
from psflow.proto import dataplane_pb2
from psflow.security.config import SecurityConfig
from psflow.transport.dataplane import auth, frames
from psflow.transport.dataplane.stream import FrameStream, tune

__all__ = ["HELLO_SECONDS", "Door", "RemoteError", "error_frame", "read_json", "send_json"]

HELLO_SECONDS = 5.0
_CLIENT = re.compile(r"^(worker|join|probe|view|admit):(\d{1,9})/gen:(\d{1,12})$")
_MAX_JSON = 64 << 10  # a re-form request or decision is a few hundred bytes
_MAX_PAYLOAD = 1 << 40


class RemoteError(Exception):
    """The peer answered with an ERROR frame; ``error`` is its typed psflow error."""

    def __init__(self, error: errors.OpError) -> None:
        super().__init__(str(error))
        self.error = error


def error_frame(stream: FrameStream, code: Code, message: str) -> None:
    """Sends one ERROR frame (best effort: the peer may be gone)."""
    status = dataplane_pb2.DataPlaneStatus(code=code.name, message=message[:4096])
    with contextlib.suppress(OSError):
        stream.send_frame(frames.Kind.ERROR, header=status.SerializeToString())


def send_json(stream: FrameStream, message: dict[str, Any]) -> None:
    """Sends ``message`` as one REQUEST frame's header."""
    stream.send_frame(frames.Kind.REQUEST, header=json.dumps(message).encode())


def read_json(stream: FrameStream, deadline: float, who: str) -> dict[str, Any]:
    """The next frame's JSON object.

    Raises:
        RemoteError: the peer sent an ERROR frame (its typed error inside).
        DeadlineExceededError: nothing came by ``deadline``.
        UnavailableError: the peer closed the connection.
        InvalidArgumentError: not a JSON object of at most 64 KB.
    """
    stream.deadline = deadline
    try:
        head = stream.read_head()
        if head.header_len > _MAX_JSON:
            raise errors.InvalidArgumentError(f"{who} sent a {head.header_len}-byte message")
        raw = stream.read_bytes(head.header_len)
        stream.discard(head.payload_len)
    except TimeoutError:
        raise errors.DeadlineExceededError(f"{who} did not answer in time") from None
    except (OSError, frames.FrameError) as e:
        raise errors.UnavailableError(f"{who} is unavailable: {e}") from None
    finally:
        stream.deadline = None
    if head.kind is frames.Kind.ERROR:
        status = dataplane_pb2.DataPlaneStatus.FromString(raw)
        code = Code[status.code] if status.code in Code.__members__ else Code.UNKNOWN
        raise RemoteError(errors.error_class(code)(status.message))
    try:
        message = json.loads(raw)
    except ValueError:
        message = None
    if head.kind is not frames.Kind.REQUEST or not isinstance(message, dict):
        raise errors.InvalidArgumentError(f"{who} sent a malformed message")
    return message


class Door:
    """The listening port of one elastic worker.

    Args:
        address: this worker's ``host:port``.
        security: the token and TLS material.
        name: how errors name this worker (``worker:0``).
        listener: an already listening socket (tests); by default ``address`` is bound.

    Raises:
        UnavailableError: the port cannot be bound.
    """

    def __init__(
        self,
        address: str,
        security: SecurityConfig,
        name: str,
        listener: socket.socket | None = None,
    ) -> None:
        from psflow.collective.peer_link import listen

        self.security = security
        self.name = name
        self._listener = listener if listener is not None else listen(address, security, name)
        self._cond = threading.Condition()
        self._generation = 0
        self._rings: list[tuple[str, int, FrameStream]] = []
        self._joins: list[tuple[FrameStream, dict[str, Any]]] = []
        self._admits: list[tuple[FrameStream, dict[str, Any]]] = []
        self.members: tuple[int, ...] = ()
        self.addresses: tuple[str, ...] = ()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="psflow-door", daemon=True)
        self._thread.start()

    @property
    def generation(self) -> int:
        """The generation this worker belongs to; older connections are refused."""
        return self._generation

    def set_generation(
        self,
        generation: int,
        members: tuple[int, ...] = (),
        addresses: tuple[str, ...] = (),
    ) -> None:
        """Moves to ``generation`` (of ``members``, every worker's address by id): queued
        links and requests of older generations are refused."""
        with self._cond:
            self._generation = generation
            self.members = tuple(members)
            self.addresses = tuple(addresses)
            stale = [s for c, g, s in self._rings if g < generation]
            self._rings = [(c, g, s) for c, g, s in self._rings if g >= generation]
            old = [s for s, m in self._joins + self._admits if m["generation"] < generation]
            self._joins = [(s, m) for s, m in self._joins if m["generation"] >= generation]
            self._admits = [(s, m) for s, m in self._admits if m["generation"] >= generation]
        for stream in stale + old:
            error_frame(stream, Code.ABORTED, self._stale_message())
            stream.close()

    def _stale_message(self) -> str:
        return f"{self.name}: the group is at generation {self._generation} now"

    # -- taking what came in ---------------------------------------------------------
    def take_ring(self, client: str, deadline: float) -> FrameStream | None:
        """The ring link dialled by ``client`` (``worker:ID/gen:G``), waiting until ``deadline``."""
        with self._cond:
            while True:
                for k, (c, _g, stream) in enumerate(self._rings):
                    if c == client:
                        del self._rings[k]
                        return stream
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._cond.wait(min(left, 0.5))

    def take_admits(self) -> list[tuple[FrameStream, dict[str, Any]]]:
        """The queued requests to join (the caller answers and closes them)."""
        with self._cond:
            admits, self._admits = self._admits, []
            return admits

    def take_joins(self, timeout: float = 0.0) -> list[tuple[FrameStream, dict[str, Any]]]:
        """The queued re-form requests (waiting up to ``timeout`` for a first one)."""
        with self._cond:
            if not self._joins and timeout > 0 and not self._closed:
                self._cond.wait(timeout)
            joins, self._joins = self._joins, []
            return joins

    # -- serving ---------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            threading.Thread(
                target=self._admit, args=(sock,), name="psflow-door-admit", daemon=True
            ).start()

    def _admit(self, sock: socket.socket) -> None:
        stream: FrameStream | None = None
        try:
            tune(sock)
            deadline = time.monotonic() + HELLO_SECONDS
            sock.settimeout(HELLO_SECONDS)
            tls = self.security.tls
            if tls is not None:
                sock = auth.server_context(tls).wrap_socket(sock, server_side=True)
            stream = FrameStream(sock, max_header=auth.HELLO_LIMIT, max_payload=0)
            stream.deadline = deadline
            head = stream.read_head()  # limits checked before anything is allocated
            if head.kind is not frames.Kind.HELLO:
                raise frames.FrameError("not a HELLO")
            raw = stream.read_bytes(head.header_len)
            why = auth.check_hello(self.security, raw)
            if why is not None:
                error_frame(stream, Code.UNAUTHENTICATED, why)
                raise frames.FrameError(why)
            client = dataplane_pb2.DataPlaneHello.FromString(raw).client
            match = _CLIENT.match(client)
            if match is None:
                error_frame(
                    stream, Code.INVALID_ARGUMENT, f"{self.name}: unknown caller {client!r}"
                )
                raise frames.FrameError(client)
            kind, generation = match.group(1), int(match.group(3))
            if kind == "view":
                stream.send_frame(frames.Kind.WELCOME)
                stream.max_header = frames.MAX_HEADER_BYTES
                view = {
                    "generation": self._generation,
                    "members": list(self.members),
                    "addresses": list(self.addresses),
                }
                send_json(stream, view)
                stream.close()
                return
            if generation < self._generation:
                error_frame(
                    stream,
                    Code.ABORTED,
                    f"{client} is of generation {generation}: {self._stale_message()}",
                )
                raise frames.FrameError("stale")
            stream.send_frame(frames.Kind.WELCOME)
            stream.max_header = frames.MAX_HEADER_BYTES
            stream.max_payload = _MAX_PAYLOAD
            if kind == "probe":
                stream.close()
                return
            if kind == "worker":
                stream.deadline = None
                sock.settimeout(None)
                with self._cond:
                    self._rings.append((client, generation, stream))
                    self._cond.notify_all()
                return
            message = read_json(stream, deadline, client)
            message["generation"] = generation
            message["id"] = int(match.group(2))
            stream.deadline = None
            sock.settimeout(None)
            with self._cond:
                (self._admits if kind == "admit" else self._joins).append((stream, message))
                self._cond.notify_all()
        except (OSError, ssl.SSLError, frames.FrameError, errors.OpError, RemoteError, ValueError):
            if stream is not None:
                stream.close()
            else:
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        """Stops listening and drops whatever is queued (idempotent)."""
        with self._cond:
            self._closed = True
            queued = [s for _, _, s in self._rings] + [s for s, _ in self._joins + self._admits]
            self._rings, self._joins, self._admits = [], [], []
            self._cond.notify_all()
        with contextlib.suppress(OSError):  # wakes the accept (close alone leaves it listening)
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        for stream in queued:
            stream.close()
