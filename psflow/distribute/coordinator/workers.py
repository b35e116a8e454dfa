"""How the coordinator reaches a worker: over gRPC, or in this process (embedded mode).

Both run a :class:`Closure` and return its value or raise its error; they
differ only in transport. A gRPC worker that cannot be reached raises
:class:`psflow.errors.WorkerUnavailableError` naming its task, so the
coordinator can re-queue the closure elsewhere.  A remote worker's closures
go over its data plane where it announces one (see
:mod:`~psflow.distribute.coordinator.closure_plane`), the same messages and
outcomes as over gRPC.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import threading
import time
from collections.abc import Mapping
from typing import Any

import cloudpickle
import grpc

from psflow import errors, settings
from psflow.distribute.coordinator import closure as closure_lib
from psflow.distribute.coordinator.closure_plane import ClosurePlane, worker_error
from psflow.distribute.coordinator.remote_value import (
    PerWorkerArgument,
    PerWorkerValues,
    RemoteValue,
)
from psflow.transport.options import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, keepalive_options
from psflow.util import nest

#: gRPC options for every psflow channel: no 4 MB cap (psflow streams big tensors itself).
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.enable_retries", 0),
    # A restarted worker is found again within about a second (gRPC's default backoff
    # grows to minutes, during which a returning process would sit unused).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def closure_timeout() -> float:
    """Seconds one closure may run on a worker (``PSFLOW_CLOSURE_TIMEOUT``, default 3600)."""
    return settings.current().closure_timeout


@dataclasses.dataclass
class Closure:
    """A function call scheduled on some worker (or on one worker, for resources)."""

    closure_id: int
    fn: Any
    args: tuple
    kwargs: dict
    remote_value: RemoteValue
    resource_key: str | None = None
    step: int = 0
    # The coordinator's bookkeeping (under its lock): a closure may run more than once
    # at a time (a speculative re-run of a late one); the first result wins.
    queued: bool = False
    running: int = 0
    finished: bool = False
    speculated: bool = False
    # whether a second run may start while the first still runs: not when the closure
    # reads a per-worker iterator (the two runs would consume two different elements)
    speculable: bool = True

    def inputs_on(self, worker_index: int) -> list[RemoteValue]:
        """The remote values (per-worker iterators, datasets) the arguments take on
        worker ``worker_index``: :meth:`args_for` waits for each of them."""
        found: list[RemoteValue] = []

        def visit(x: Any) -> Any:
            if isinstance(x, PerWorkerValues):
                x = x.values[worker_index]
            if isinstance(x, RemoteValue):
                found.append(x)
            return x

        for part in (tuple(self.args), dict(self.kwargs)):
            if part:
                nest.map_structure(visit, part)
        return found

    def args_for(self, worker_index: int) -> tuple[tuple, dict]:
        """The arguments with every per-worker value replaced by this worker's component."""

        def pick(x: Any) -> Any:
            if isinstance(x, PerWorkerArgument):
                return x.for_worker(worker_index)
            if isinstance(x, PerWorkerValues):
                x = x.values[worker_index]
            return x.get() if isinstance(x, RemoteValue) else x

        args = nest.map_structure(pick, tuple(self.args)) if self.args else ()
        kwargs = nest.map_structure(pick, dict(self.kwargs)) if self.kwargs else {}
        return tuple(args), dict(kwargs)


class Worker(abc.ABC):
    """A worker task the coordinator can run closures on.

    ``max_in_flight``: how many closures the coordinator may have sent it at once
    (a gRPC worker runs them one at a time itself; the chief's own thread cannot).
    """

    max_in_flight = 1
    #: whether the coordinator health-checks it (a remote process can freeze; the chief cannot)
    probed = False

    def __init__(self, index: int, task: str) -> None:
        self.index = index
        self.task = task

    @abc.abstractmethod
    def run(
        self,
        session_id: str,
        closure: Closure,
        functions: closure_lib.FunctionCache,
        timeout: float | None = None,
    ) -> Any:
        """Runs the closure and returns its value (or raises its error).

        ``timeout``: seconds the call may take (default: ``PSFLOW_CLOSURE_TIMEOUT``).
        """

    def end_session(self, session_id: str) -> None:
        """Forgets the session's state on the worker."""

    def forget_functions(self) -> None:
        """The worker restarted: every function must be sent again (none are cached here)."""

    def healthy(self, timeout: float = 2.0) -> bool:
        """Whether the worker answers now."""
        return True

    def close(self) -> None:
        """Releases connections."""


class InProcessWorker(Worker):
    """The chief itself as the only worker (embedded mode): no pickling, no RPC."""

    def __init__(self, index: int = 0, task: str = "worker:0", enter: Any = None) -> None:
        super().__init__(index, task)
        self._resources: dict[str, Any] = {}
        self._enter = enter

    def run(
        self,
        session_id: str,
        closure: Closure,
        functions: closure_lib.FunctionCache,
        timeout: float | None = None,
    ) -> Any:
        args, kwargs = closure.args_for(self.index)
        resolve = self._resolve
        args = nest.map_structure(resolve, args) if args else ()
        kwargs = nest.map_structure(resolve, kwargs) if kwargs else {}
        if self._enter is not None:
            with self._enter(closure.step, f"{session_id}/c{closure.closure_id}"):
                value = closure.fn(*args, **kwargs)
        else:
            value = closure.fn(*args, **kwargs)
        if closure.resource_key is not None:
            self._resources[closure.resource_key] = value
            return closure_lib.ResourceHandle(closure.resource_key)
        return value

    def _resolve(self, x: Any) -> Any:
        if isinstance(x, closure_lib.ResourceHandle):
            return self._resources[x.key]
        return x

    def end_session(self, session_id: str) -> None:
        self._resources.clear()


class GrpcWorker(Worker):
    """A worker process reached over gRPC (it runs one closure at a time: see
    ``worker.executor``, so a second one may wait there), its closures over its
    data plane where it announces one.

    Args:
        index: the worker's task index.
        address: ``host:port``.
        security: token and TLS material to present (a
            ``psflow.security.config.SecurityConfig``; default: the environment's).
        credentials: channel credentials overriding ``security``'s TLS (closures
            then go over gRPC only: the data plane presents ``security``'s).
        metadata: extra metadata sent with every call (after ``security``'s token).
        training: the strategy's training mode (a ``SyncConfig``), sent with
            every closure; None: the worker keeps its own.
        compression: the strategy's push compression (a codec name, or variable
            name -> codec), sent with the training mode.
        keepalive_time: seconds between keepalive pings on the channel.
        keepalive_timeout: seconds a ping may go unanswered before the channel
            drops its connection: a closure in flight then fails with
            ``WorkerUnavailableError`` (its worker's host vanished, or a
            partition holds every byte) instead of waiting for its deadline;
            on the data plane, once a health probe fails with nothing heard
            from the worker for this long (see ``closure_plane``).
        data_plane: whether closures may go over the worker's data plane
            (None: ``PSFLOW_CLOSURE_PLANE``, on unless ``off``).
    """

    def __init__(
        self,
        index: int,
        address: str,
        *,
        security: Any = None,
        credentials: Any = None,
        metadata: tuple = (),
        training: Any = None,
        compression: Any = None,
        keepalive_time: float = KEEPALIVE_TIME_MS / 1000,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT_MS / 1000,
        data_plane: bool | None = None,
    ) -> None:
        super().__init__(index, f"worker:{index}")
        self.max_in_flight = 2
        self.probed = True
        from psflow.proto import worker_pb2, worker_pb2_grpc
        from psflow.security.config import default_security
        from psflow.security.grpc_auth import open_channel

        self._pb = worker_pb2
        self._training = (
            None
            if training is None
            else worker_pb2.TrainingMode(
                mode=training.mode,
                num_workers=training.num_workers,
                sync_timeout=training.timeout,
                compression=compression if isinstance(compression, str) else "",
                compression_by_variable=(compression if isinstance(compression, Mapping) else None),
            )
        )
        self.address = address
        self._security = default_security() if security is None else security
        # the PS channels' keepalive: a silent partition ends the calls in flight
        options = CHANNEL_OPTIONS + keepalive_options(
            round(keepalive_time * 1000), round(keepalive_timeout * 1000)
        )
        if credentials is not None:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = open_channel(address, self._security, options)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._metadata = (*self._security.call_metadata(), *metadata)
        self._sent: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._timeout = closure_timeout()
        self._keepalive_timeout = keepalive_timeout
        if data_plane is None:
            data_plane = settings.current().closure_plane
        self._plane = ClosurePlane(
            address,
            self.task,
            self._security,
            self.status,
            enabled=data_plane and credentials is None,
        )

    def _call(self, method: Any, request: Any, timeout: float) -> Any:
        try:
            return method(request, timeout=timeout, metadata=self._metadata or None)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                from psflow.security.probe import diagnose_unavailable

                # A worker refusing our certificate is not a lost worker: no re-queueing.
                reason = diagnose_unavailable(self.address, self._security, e.details() or "")
                if reason is not None:
                    raise errors.UnauthenticatedError(
                        f"{self.task} at {self.address}: {reason}", task=self.task
                    ) from None
            raise worker_error(
                errors.from_grpc(e, task=self.task), self.task, self.address
            ) from None

    def run(
        self,
        session_id: str,
        closure: Closure,
        functions: closure_lib.FunctionCache,
        timeout: float | None = None,
    ) -> Any:
        key, fn_bytes = functions.key_and_bytes(closure.fn)
        args, kwargs = closure.args_for(self.index)
        arg_bytes = closure_lib.pickle_arguments(args, kwargs)
        for _attempt in range(2):
            with self._lock:
                known = (session_id, key) in self._sent
            request = self._pb.RunClosureRequest(
                session_id=session_id,
                closure_id=closure.closure_id,
                function_key=key,
                function=b"" if known else fn_bytes,
                arguments=arg_bytes,
                resource_key=closure.resource_key or "",
                step=closure.step,
                training=self._training,
            )
            left = self._timeout if timeout is None else timeout
            reply = self._plane.run(request, left)
            if reply is None:  # no data plane (or a closure above its limit): gRPC's call
                reply = self._call(self._stub.RunClosure, request, left)
            if reply.function_missing:
                with self._lock:
                    self._sent.discard((session_id, key))
                continue
            with self._lock:
                self._sent.add((session_id, key))
            if reply.missing_resource:
                raise closure_lib.MissingResourceError(reply.missing_resource, task=self.task)
            if reply.HasField("error"):
                raise closure_lib.rebuild_error(reply.error, self.task)
            if closure.resource_key is not None:
                return closure_lib.ResourceHandle(closure.resource_key)
            return cloudpickle.loads(reply.result) if reply.result else None
        raise errors.InternalError(f"{self.task} kept losing function {key!r}", task=self.task)

    @property
    def data_plane_address(self) -> str | None:
        """Where its closures go over the worker's data plane (None: over gRPC, or
        no closure sent yet)."""
        return self._plane.address_in_use

    def forget_functions(self) -> None:
        """The worker restarted: every function must be sent again."""
        with self._lock:
            self._sent.clear()

    def end_session(self, session_id: str) -> None:
        with contextlib.suppress(errors.OpError):
            self._call(
                self._stub.EndSession, self._pb.EndSessionRequest(session_id=session_id), 5.0
            )

    def status(self, timeout: float = 2.0) -> Any:
        """The worker's GetStatus reply."""
        return self._call(self._stub.GetStatus, self._pb.GetStatusRequest(), timeout)

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            self.status(timeout)
        except errors.OpError:
            # the probe is the data plane's keepalive ping (see closure_plane)
            self._plane.unanswered(self._keepalive_timeout)
            return False
        self._plane.answered()
        return True

    def wait_ready(self, timeout: float) -> None:
        """Waits until the worker answers.

        Raises:
            WorkerUnavailableError: it did not answer within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                grpc.channel_ready_future(self._channel).result(timeout=max(min(left, 2.0), 0.01))
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() >= deadline:
                    raise errors.WorkerUnavailableError(
                        f"{self.task} at {self.address} did not become reachable within {timeout}s",
                        task=self.task,
                    ) from None

    def close(self) -> None:
        self._plane.close()
        self._channel.close()
