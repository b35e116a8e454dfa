"""The client core: what every PS client does the same way.

Each idea written once and used by :class:`~psflow.transport.PSClient`
(one dense PS task), :class:`~psflow.transport.EmbeddingClient` (the table
shards of every task), the data-plane client and the session's fan-out:

- :class:`~psflow.transport.started.Started`, ``fan_out`` and ``gather``:
  one started-call type, one fan-out and its failure rule (their own module,
  below the data-plane client that returns them).
- :class:`RetryPolicy` and :meth:`RetryPolicy.run`: one retry loop with
  backoff and jitter, within one deadline, that turns every failure into the
  typed error naming the method, the task and its address.  Requests that are
  not idempotent carry an exactly-once id (:class:`RequestIds`) chosen before
  the first attempt, so every attempt carries the same one.
- :class:`PlaneLink`: one PS task's data plane, asked for once over gRPC,
  with one fallback rule (see its docstring).
- :class:`Endpoint`: one PS task as every client reaches it (its channel,
  its plane, its retry policy, one attempt of a :class:`Call` on either
  transport).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from psflow import settings
from psflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    OpError,
    UnauthenticatedError,
    UnavailableError,
    to_grpc_code,
)
from psflow.proto import ps_pb2
from psflow.security.config import SecurityConfig
from psflow.security.grpc_auth import open_channel
from psflow.security.probe import diagnose_unavailable

from . import framing
from .dataplane import DataPlaneClient
from .options import channel_options
from .service import method_path
from .started import Started
from .status import status_error

__all__ = ["Call", "Endpoint", "PlaneLink", "RequestIds", "RetryPolicy", "rpc_error"]

T = TypeVar("T")

log = logging.getLogger(__name__)

# how long the first connection to an announced data plane may take before the
# client settles for gRPC
PLANE_CONNECT_TIMEOUT = 5.0


def rpc_error(method: str, task: str, address: str, e: grpc.RpcError) -> OpError:
    """The typed error of a failed gRPC call (one mapping with the data plane's)."""
    code = e.code()
    return status_error(
        method,
        task,
        address,
        code.value[0] if code is not None else None,
        e.details() or "",
        e.trailing_metadata() if isinstance(e, grpc.Call) else (),
    )


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """When and how often a retry-safe call is repeated (always within its deadline).

    ``attempt_timeout``: each attempt's own deadline (None: the call's, what
    is left of it); with it, a timed-out attempt can be repeated.
    """

    max_attempts: int = 10
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    retry_codes: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})
    attempt_timeout: float | None = None

    def backoff(self, failures: int) -> float:
        """The wait after ``failures`` failures in a row (before any jitter):
        ``initial_backoff`` times ``multiplier`` per failure after the first,
        at most ``max_backoff``."""
        return min(
            self.max_backoff, self.initial_backoff * self.multiplier ** min(failures - 1, 64)
        )

    def run(
        self,
        method: str,
        task: str,
        address: str,
        attempt: Callable[[float], T],
        timeout: float,
        *,
        diagnose: Callable[[grpc.RpcError, float], OpError | None] | None = None,
    ) -> T:
        """``attempt(time_left)`` until it succeeds, fails for good, or the deadline passes.

        ``timeout``: the call's deadline, in seconds from now.  A ``grpc.RpcError``
        becomes its typed error (``diagnose(e, left)``, asked once per call,
        may name a better one: a TLS handshake refusing us); a typed error (the
        data plane's) is retried as its gRPC twin.

        Raises:
            OpError: the last attempt's typed error, or ``DeadlineExceededError``.
        """
        per_attempt = self.attempt_timeout
        deadline = time.monotonic() + timeout
        for n in itertools.count(1):
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(
                    f"{method} to {task} at {address}: deadline passed before attempt {n}",
                    task=task,
                )
            try:
                return attempt(left if per_attempt is None else min(left, per_attempt))
            except grpc.RpcError as e:
                left = deadline - time.monotonic()
                problem = diagnose(e, max(left, 0.05)) if diagnose and n == 1 else None
                if problem is not None:
                    raise problem from None
                error: OpError = rpc_error(method, task, address, e)
            except OpError as e:
                e.task = e.task or task
                error = e
            left, backoff = deadline - time.monotonic(), self.backoff(n)
            if (
                to_grpc_code(error) not in self.retry_codes
                or n >= self.max_attempts
                or left <= backoff
            ):
                raise error from None
            time.sleep(backoff * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")  # pragma: no cover


class RequestIds:
    """A client's exactly-once request ids, ``(client_id, 1)``, ``(client_id, 2)``...
    (``client_id`` default: a fresh UUID); thread-safe."""

    def __init__(self, client_id: str | None = None) -> None:
        self.client_id = client_id or uuid.uuid4().hex
        self._sequence = itertools.count(1)
        self._lock = threading.Lock()

    def __call__(self) -> tuple[str, int]:
        with self._lock:
            return self.client_id, next(self._sequence)


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a client, either way it can travel: on the data plane, the
    ``header`` and ``payload`` buffers of ``method`` (``nbytes`` of payload)
    and ``read(reply)`` its reply's value; or ``over_grpc(time_left)``, one
    attempt of the whole call over gRPC (None: a call only started on the plane)."""

    method: str
    header: bytes
    payload: Sequence[Any]
    nbytes: int
    read: Callable[[tuple[bytes, memoryview]], Any]
    over_grpc: Callable[[float], Any] | None


class PlaneLink:
    """One PS task's data plane: asked for over gRPC on first use, then reused.

    The one fallback rule: a PS that answers it runs no data plane (or knows
    no ``DataPlaneInfo``: one from before) is reached over gRPC for good; an
    announced plane that cannot be connected on first use, while gRPC works,
    is logged once and that PS is reached over gRPC; once a plane of this PS
    has worked, a failure to connect is an ordinary transport error (raised,
    and retried as the gRPC path's).  After an UNAVAILABLE failure the next
    call asks again (a restarted PS listens on a new port).

    Args:
        address: the task's gRPC ``host:port``.
        task: its name, for errors and logs.
        ask: the ``DataPlaneInfo`` call (seconds left -> reply; raises ``grpc.RpcError``).
        enabled: False: always gRPC.
        route: an address to reach the plane at instead of the announced one.
        client: makes the plane's client (a :class:`DataPlaneClient` or a subclass).
        carries: what goes over gRPC instead when the plane cannot be used (the log line).
    """

    def __init__(
        self,
        address: str,
        task: str,
        security: SecurityConfig,
        client_name: str,
        ask: Callable[[float], Any],
        *,
        enabled: bool,
        route: str = "",
        client: Callable[..., DataPlaneClient] = DataPlaneClient,
        carries: str = "its pushes, pulls and table calls",
    ) -> None:
        self.address, self.task, self._security = address, task, security
        self._client_name, self._ask, self._route = client_name, ask, route
        self._client, self._carries = client, carries
        self._plane: DataPlaneClient | bool | None = None if enabled else False
        self._lock = threading.Lock()
        self._worked = False
        self.max_payload = 0

    @property
    def known(self) -> DataPlaneClient | None:
        """The plane if connected already (asks nothing)."""
        plane = self._plane
        return plane if isinstance(plane, DataPlaneClient) else None

    def get(self, left: float) -> DataPlaneClient | None:
        """The plane, asked for on first use (None: use gRPC).

        Raises:
            grpc.RpcError, OpError: the question failed (the caller's attempt
                fails as any call would; the next one asks again).
        """
        plane = self._plane
        if plane is not None:
            return plane or None
        with self._lock:
            if self._plane is None:
                self._plane = self._connect(left)
            return self._plane or None

    def _connect(self, left: float) -> DataPlaneClient | bool:
        try:
            info: ps_pb2.DataPlaneInfoResponse = self._ask(left)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a PS from before the data plane
                return False
            raise
        if not info.port and not info.address:
            return False
        address = self._route or info.address or f"{self.address.rpartition(':')[0]}:{info.port}"
        plane = self._client(address, self._security, task=self.task, client_name=self._client_name)
        try:
            plane.connect(min(left, PLANE_CONNECT_TIMEOUT))
        except OpError as e:
            plane.close()
            if self._worked:  # not the first use: an ordinary transport failure
                raise
            log.warning(
                "%s announces a data plane at %s, which cannot be used (%s): %s go over gRPC",
                self.task,
                address,
                e,
                self._carries,
            )
            return False
        self.max_payload = info.max_payload_bytes
        self._worked = True
        return plane

    def start(
        self,
        call: Call,
        timeout: float,
        again: Callable[[float], Any],
        retried: tuple[type[OpError], ...],
        *,
        sink: Any = None,
        budget: float | None = None,
    ) -> Started | None:
        """``call`` sent on the plane now, its reply read by the result's
        ``result()`` (``call.read(reply)``; see :meth:`recovery` for a failure).
        None, having sent nothing, where the plane is not known yet (or there
        is none) or the payload is above its limit.
        """
        plane = self.known
        if plane is None or call.nbytes > self.max_payload:
            return None
        recover = self.recovery(plane, call.method, timeout, again, retried, budget)
        return plane.send(
            call.method, call.header, call.payload, timeout,
            sink=sink, read=call.read, recover=recover,
        )  # fmt: skip

    def recovery(
        self,
        plane: DataPlaneClient,
        method: str,
        timeout: float,
        again: Callable[[float], Any],
        retried: tuple[type[OpError], ...],
        budget: float | None = None,
    ) -> Callable[[OpError], Any]:
        """What a call to ``method`` on ``plane`` does where sending it or its
        reply failed: with one of ``retried``, ``again(time_left)`` makes the
        call anew (the same request, exactly-once id included) within
        ``budget`` seconds from now (default ``timeout``); else the error is raised."""
        deadline = time.monotonic() + (timeout if budget is None else budget)

        def recover(e: OpError) -> Any:
            if not isinstance(e, retried):
                raise e
            self.failed(plane, e)
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(
                    f"{method} to {self.task} at {self.address}: Deadline Exceeded",
                    task=self.task,
                )
            return again(left)

        return recover

    def failed(self, plane: DataPlaneClient | None, error: BaseException) -> None:
        """After an UNAVAILABLE failure on ``plane`` the next call asks the PS again."""
        if plane is None or not isinstance(error, UnavailableError):
            return
        with self._lock:
            if self._plane is plane:
                self._plane = None
        plane.close()

    def close(self) -> None:
        """Closes the plane's connections; gRPC from now on."""
        with self._lock:
            plane, self._plane = self._plane, False
        if isinstance(plane, DataPlaneClient):
            plane.close()


class Endpoint:
    """One PS task as every client reaches it: a gRPC channel presenting the
    ``security`` configuration's token and certificate, the task's data plane
    (a :class:`PlaneLink`, asked for with the PS service's ``DataPlaneInfo``),
    and the retry policy its calls run under.

    Args:
        address, task: the task's ``host:port`` and its name, for errors.
        client_id: this client's name on the data plane.
        retry: the default policy of :meth:`run`.
        data_plane: None: the process setting (``PSFLOW_DATA_PLANE``).
    """

    def __init__(
        self,
        address: str,
        task: str,
        security: SecurityConfig,
        client_id: str,
        max_message_bytes: int,
        retry: RetryPolicy,
        data_plane: bool | None = None,
    ) -> None:
        self.address, self.task, self.security, self.retry = address, task, security, retry
        self.channel = open_channel(address, security, channel_options(max_message_bytes))
        self._metadata = security.call_metadata() or None
        self.closed = False
        process = settings.current()
        ask = self.stub(method_path("DataPlaneInfo"), ps_pb2.DataPlaneInfoResponse.FromString)
        self.link = PlaneLink(
            address,
            task,
            security,
            client_id,
            lambda left: ask(ps_pb2.DataPlaneInfoRequest(), timeout=left),
            enabled=process.data_plane if data_plane is None else data_plane,
            route=dict(process.data_plane_routes).get(address, ""),
        )

    def stub(
        self, path: str, deserialize: Callable[[bytes], Any], kind: str = "unary_unary"
    ) -> Callable[..., Any]:
        """The gRPC method at ``path`` (``kind``: its cardinality), called with
        the security's metadata; a request may be a message or its bytes."""
        factory = getattr(self.channel, kind)
        stub = factory(
            path, request_serializer=framing.serialize, response_deserializer=deserialize
        )
        return stub if self._metadata is None else functools.partial(stub, metadata=self._metadata)

    def run(
        self,
        method: str,
        attempt: Callable[[float], T],
        timeout: float,
        policy: RetryPolicy | None = None,
    ) -> T:
        """``attempt(time_left)`` under ``policy`` (default this endpoint's)
        within ``timeout`` seconds; see :meth:`RetryPolicy.run`.

        Raises:
            InvalidArgumentError: the client was closed.
            OpError: the call's typed error.
        """
        if self.closed:
            raise InvalidArgumentError(f"the client of {self.task} at {self.address} is closed")
        return (policy or self.retry).run(
            method,
            self.task,
            self.address,
            attempt,
            timeout,
            diagnose=functools.partial(self._diagnose, method),
        )

    def _diagnose(self, method: str, e: grpc.RpcError, left: float) -> OpError | None:
        """An ``UnauthenticatedError`` when an UNAVAILABLE ``e`` is the TLS handshake refusing us."""
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        reason = diagnose_unavailable(
            self.address, self.security, e.details() or "", min(left, 2.0)
        )
        if reason is None:
            return None
        return UnauthenticatedError(
            f"{method} to {self.task} at {self.address} failed: {reason}", task=self.task
        )

    def attempt(self, call: Call, left: float, **kwargs: Any) -> Any:
        """One attempt of ``call``: on the data plane when the task has one and
        the payload fits its limit (``kwargs`` go to :meth:`DataPlaneClient.call`),
        else over gRPC."""
        plane = self.link.get(left)
        if plane is None or call.nbytes > self.link.max_payload:
            return call.over_grpc(left)
        try:
            return call.read(plane.call(call.method, call.header, call.payload, left, **kwargs))
        except UnavailableError as e:
            self.link.failed(plane, e)
            raise

    def close(self) -> None:
        """Closes the plane's connections and the channel."""
        self.closed = True
        self.link.close()
        self.channel.close()
