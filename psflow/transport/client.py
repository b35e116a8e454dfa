"""``PSClient``: how workers and the chief talk to one parameter-server task.

Every call has a deadline (``timeout``, default the client's).  Calls that are
safe to repeat — reads, idempotent writes (create with the same spec, assign,
configure, save, restore) and calls carrying a request id (push, assign_add,
assign_sub) — are retried with exponential backoff and jitter when the server
is unavailable, until the deadline.  Failures surface as typed psflow errors
naming the method, the task and its address, e.g.
``UnavailableError("Pull to ps:1 at 127.0.0.1:1234 failed: ...")``.

Payloads up to ``stream_threshold`` bytes go in one unary message (one round
trip); larger ones are streamed in ``chunk_bytes`` chunks.  Pulls and pushes
are batched: one RPC for many variables.

Security, data-plane discovery and its fallback to gRPC are the client
core's (:class:`~psflow.transport.core.Endpoint`): pushes and pulls go over a
PS's data plane when it announces one, the rest over gRPC.

Concurrency: the client is thread-safe, and ``pull_async``/``push_async``
(or :meth:`PSClient.submit` for any method) return futures, so calls to several
PS tasks run at the same time::

    futures = [c.pull_async(names_on[c.task]) for c in clients]
    values = [f.result() for f in futures]

Example:
    >>> client = PSClient("127.0.0.1:2222", task="ps:0")        # doctest: +SKIP
    >>> client.create_variable("w", np.zeros(3, np.float32))     # doctest: +SKIP
    >>> client.configure_optimizer(["w"], {"name": "sgd"})       # doctest: +SKIP
    >>> client.push({"w": np.ones(3, np.float32)})               # doctest: +SKIP
    >>> client.pull(["w"])                                       # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from psflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    OpError,
    ResourceExhaustedError,
    UnavailableError,
)
from psflow.proto import ps_pb2
from psflow.ps.push_types import Gradient, PushContext, PushReply
from psflow.security.config import SecurityConfig, default_security
from psflow.wire import codec

from . import framing, messages
from .core import Call, Endpoint, RequestIds, RetryPolicy
from .messages import VariableDescription
from .options import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_STREAM_THRESHOLD,
)
from .service import METHODS, method_path
from .started import Started

__all__ = ["PSClient", "PushReply", "RetryPolicy", "VariableDescription"]

T = TypeVar("T")


def _assigner(op: int, doc: str) -> Callable[..., dict[str, int]]:
    """A public write method of ``op`` (assign, assign_add, assign_sub): one signature."""

    def method(
        self: PSClient,
        name_or_values: str | Mapping[str, Any],
        value: Any = None,
        *,
        timeout: float | None = None,
        request_id: tuple[str, int] | None = None,
    ) -> dict[str, int]:
        values = {name_or_values: value} if isinstance(name_or_values, str) else name_or_values
        return self._assign(op, values, timeout, request_id)

    method.__doc__ = doc
    return method


class PSClient:
    """A client of one parameter-server task: a typed facade over the client
    core (:class:`~psflow.transport.core.Endpoint`: channel, retries, data-plane
    discovery) and the message format (:mod:`psflow.transport.messages`).

    Args:
        address: ``host:port`` of the task.
        task: its name in the cluster (``"ps:0"``), used in errors.
        timeout: default deadline of a call, in seconds.
        retry: retry policy of retry-safe calls.
        chunk_bytes: payload bytes per streamed message.
        stream_threshold: payloads above this many bytes are streamed.
        max_message_bytes: gRPC message size limit of the channel.
        client_id: identity for exactly-once pushes (default: a fresh UUID).
        max_workers: threads serving the ``*_async`` methods.
        security: token and TLS material to present (default: the environment's).
        data_plane: push and pull over the PS's data plane when it announces one
            (default: on unless ``PSFLOW_DATA_PLANE=off``).
    """

    def __init__(
        self,
        address: str,
        task: str = "ps:0",
        *,
        timeout: float = 60.0,
        retry: RetryPolicy | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        stream_threshold: int = DEFAULT_STREAM_THRESHOLD,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        client_id: str | None = None,
        max_workers: int = 4,
        security: SecurityConfig | None = None,
        data_plane: bool | None = None,
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes > max_message_bytes // 2:
            raise InvalidArgumentError(
                f"chunk_bytes {chunk_bytes} must be in (0, {max_message_bytes // 2}]"
            )
        self.address, self.task, self.timeout = address, task, timeout
        self.retry = retry or RetryPolicy()
        self.chunk_bytes = chunk_bytes
        self.stream_threshold = min(stream_threshold, max_message_bytes // 2)
        self.next_request_id = RequestIds(client_id)  # a fresh (client_id, sequence) per call
        self.client_id = self.next_request_id.client_id
        self._max_workers = max_workers
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        # name -> (shape, bytes per row): sizes replies
        self._specs: dict[str, tuple[tuple[int, ...], int]] = {}
        self.security = default_security() if security is None else security
        self._end = Endpoint(
            address, task, self.security, self.client_id, max_message_bytes, self.retry, data_plane
        )
        self._stubs = {
            name: self._end.stub(
                method_path(name), bytes if framed else reply.FromString, kind.value
            )
            for name, (kind, _, reply, _, framed) in METHODS.items()
        }

    # -- plumbing ---------------------------------------------------------------
    def __repr__(self) -> str:
        return f"PSClient({self.address!r}, task={self.task!r})"

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel and the async thread pool."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._end.close()

    @property
    def data_plane_address(self) -> str | None:
        """The data plane pushes and pulls go to, once known (None: gRPC, or not asked yet)."""
        plane = self._end.link.known
        return None if plane is None else plane.address

    def _run(self, method: str, attempt: Callable[[float], T], timeout: float | None) -> T:
        """``attempt(time_left)`` under the client's retry policy, within the deadline."""
        return self._end.run(method, attempt, self.timeout if timeout is None else timeout)

    def _unary(self, method: str, request: Any, timeout: float | None) -> Any:
        return self._run(method, lambda left: self._stubs[method](request, timeout=left), timeout)

    def _framed(self, method: str, header: bytes, arrays: Sequence[np.ndarray], left: float) -> Any:
        """One gRPC attempt of a header + payload request: one message up to
        ``stream_threshold`` bytes, else streamed in ``chunk_bytes`` chunks."""
        if sum(a.nbytes for a in arrays) > self.stream_threshold:
            chunks = framing.payload_messages(header, arrays, self.chunk_bytes)
            return self._stubs[f"{method}Stream"](chunks, timeout=left)
        message = framing.encode_message(header, [framing.byte_view(a) for a in arrays])
        return self._stubs[method](message, timeout=left)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Runs ``fn(*args, **kwargs)`` (e.g. ``client.pull``) on the client's thread pool."""
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self._max_workers, thread_name_prefix=f"psclient-{self.task}"
                )
        return self._executor.submit(fn, *args, **kwargs)

    # -- writes -------------------------------------------------------------------
    def _write(
        self, header: ps_pb2.WriteHeader, arrays: list[np.ndarray], timeout: float | None
    ) -> ps_pb2.WriteResponse:
        raw = header.SerializeToString()
        return self._run("Write", lambda left: self._framed("Write", raw, arrays, left), timeout)

    def create_variables(
        self,
        values: Mapping[str, Any],
        *,
        trainable: bool | Mapping[str, bool] = True,
        optimizer: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> dict[str, bool]:
        """Creates variables with initial ``values``; returns ``{name: created}``.

        Idempotent: a variable that exists with the same dtype, shape and
        trainability is left unchanged (``created`` is False).

        Raises:
            AlreadyExistsError: one exists with a conflicting spec (none is created).
        """
        rule = json.dumps(optimizer) if optimizer else ""
        header, arrays = messages.encode_write(
            ps_pb2.WRITE_OP_CREATE, values, None, trainable, rule
        )
        reply = self._write(header, arrays, timeout)
        for name, arr in zip(values, arrays, strict=True):
            self._seen(name, arr.dtype, arr.shape)
        return {name: bool(c) for name, c in zip(values, reply.created, strict=True)}

    def create_variable(
        self,
        name: str,
        value: Any,
        *,
        trainable: bool = True,
        optimizer: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Creates one variable; True if created, False if it existed identically."""
        return self.create_variables(
            {name: value}, trainable=trainable, optimizer=optimizer, timeout=timeout
        )[name]

    def _assign(
        self,
        op: int,
        values: Mapping[str, Any],
        timeout: float | None,
        request_id: tuple[str, int] | None,
    ) -> dict[str, int]:
        # assign is idempotent; add/sub carry an id so their retries apply once. A caller's
        # id (a closure's, stable across re-runs) is honoured for every op, so a re-run
        # closure's writes are deduplicated by the PS, not only this call's retries.
        if request_id is None and op != ps_pb2.WRITE_OP_ASSIGN:
            request_id = self.next_request_id()
        reply = self._write(*messages.encode_write(op, values, request_id), timeout)
        return dict(zip(values, reply.versions, strict=True))

    assign = _assigner(
        ps_pb2.WRITE_OP_ASSIGN,
        """Replaces values: ``assign("w", x)`` or ``assign({"w": x, ...})``; returns versions.

        ``request_id`` (``(client_id, sequence)``): a second request with the same
        id is answered from the PS's record instead of being applied again.
        """,
    )
    assign_add = _assigner(
        ps_pb2.WRITE_OP_ASSIGN_ADD,
        """Adds to values (exactly once, even if retried); returns versions.

        ``request_id``: the caller's id (default a fresh one of this client); every
        request carrying the same id is applied once.
        """,
    )
    assign_sub = _assigner(
        ps_pb2.WRITE_OP_ASSIGN_SUB,
        """Subtracts from values (exactly once, even if retried); returns versions.

        ``request_id``: as for :meth:`assign_add`.
        """,
    )

    def configure_optimizer(
        self, names: Sequence[str], rule_config: dict[str, Any], *, timeout: float | None = None
    ) -> tuple[str, ...]:
        """Attaches an update rule (``{"name": "adam", ...}``) to variables; returns slot names."""
        request = ps_pb2.ConfigureOptimizerRequest(
            names=list(names), optimizer_json=json.dumps(rule_config)
        )
        reply = self._unary("ConfigureOptimizer", request, timeout)
        return tuple(reply.slot_names)

    # -- pulls ----------------------------------------------------------------------
    def _seen(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        """Remembers a variable's spec: its later pulls are sized by it."""
        self._specs[name] = (shape, math.prod(shape[1:]) * dtype.itemsize)

    def _expected_bytes(self, request: ps_pb2.PullRequest) -> int | None:
        """The reply's payload size if every variable's spec is known, else None."""
        total = 0
        for item in request.items:
            known = self._specs.get(item.name)
            if known is None:
                return None
            shape, row_bytes = known
            rows = shape[0] if shape else 1
            if item.HasField("indices"):
                rows = len(item.indices.data) // 8
            total += rows * row_bytes
        return total

    def _pull(self, request: ps_pb2.PullRequest, out, rows: bool, timeout: float | None):
        expected = self._expected_bytes(request)
        raw = request.SerializeToString()

        def decoder() -> messages.PullDecoder:
            return messages.PullDecoder(out, rows, self._seen)

        def stream(left: float) -> list[tuple[np.ndarray, int]]:
            return decoder().messages(self._stubs["PullStream"](raw, timeout=left))

        def over_grpc(left: float) -> list[tuple[np.ndarray, int]]:
            if expected is not None and expected <= self.stream_threshold:
                try:
                    return decoder().messages([self._stubs["Pull"](raw, timeout=left)])
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise  # else: sizes changed behind our back; stream it
            return stream(left)

        def attempt(left: float) -> list[tuple[np.ndarray, int]]:
            deadline, one = time.monotonic() + left, decoder()
            try:
                call = Call("Pull", raw, (), expected or 0, one.frame, over_grpc)
                # without ``out`` the reply lands in a new buffer the arrays view
                return self._end.attempt(call, left, sink=None if out is None else one.sink)
            except ResourceExhaustedError:  # larger than a data-plane frame: stream it
                return stream(max(deadline - time.monotonic(), 0.001))

        return self._run("Pull", attempt, timeout)

    def pull(
        self,
        names: str | Sequence[str],
        *,
        out: Sequence[np.ndarray | None] | None = None,
        return_versions: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Reads variables in one RPC.

        Args:
            names: the variables (a single name returns a single array).
            out: optional arrays to fill in place (matching dtype and shape).
            return_versions: also return each value's version.

        Returns:
            ``[array, ...]`` (or ``([array, ...], [version, ...])``).
        """
        single = isinstance(names, str)
        name_list = [names] if single else list(names)
        if out is not None and len(out) != len(name_list):
            raise InvalidArgumentError(f"{len(out)} out arrays for {len(name_list)} names")
        pulled = self._pull(messages.pull_request(name_list, self.chunk_bytes), out, False, timeout)
        arrays, versions = [a for a, _ in pulled], [v for _, v in pulled]
        if single:
            return (arrays[0], versions[0]) if return_versions else arrays[0]
        return (arrays, versions) if return_versions else arrays

    def start_pull(self, names: Sequence[str], *, timeout: float | None = None) -> Started | None:
        """Sends :meth:`pull`'s request for ``names`` on the data plane now and
        returns without reading the reply: its ``result()`` reads it as
        ``[(array, version), ...]`` (and pulls again where that attempt failed).
        None, having sent nothing, where the pull cannot go that way (no data
        plane known yet, or none, or a reply above its limit)."""
        request = messages.pull_request(names, self.chunk_bytes)
        expected = self._expected_bytes(request)
        if expected is None or self._end.closed:
            return None
        one = messages.PullDecoder(None, False, self._seen)
        return self._end.link.start(
            Call("Pull", request.SerializeToString(), (), expected, one.frame, None),
            self.timeout if timeout is None else timeout,
            lambda left: self._pull(request, None, False, left),
            # a reply above the frame limit streams over gRPC, as pull() does
            (UnavailableError, DeadlineExceededError, ResourceExhaustedError),
        )

    def pull_rows(
        self,
        name: str,
        indices: Any,
        *,
        return_version: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Reads rows ``indices`` of a variable: shape ``(len(indices), *row_shape)``."""
        idx = codec.to_host(indices)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"row indices must be a 1-D integer array, got {idx.dtype}{list(idx.shape)}"
            )
        idx = idx.astype("<i8", copy=False)
        request = messages.pull_request([name], self.chunk_bytes, idx)
        ((array, version),) = self._pull(request, None, True, timeout)
        return (array, version) if return_version else array

    def pull_async(self, names: str | Sequence[str], **kwargs: Any) -> concurrent.futures.Future:
        """:meth:`pull` on the client's thread pool; returns a future."""
        return self.submit(self.pull, names, **kwargs)

    # -- pushes ------------------------------------------------------------------------
    def push(
        self,
        grads: Mapping[str, Any] | Sequence[Gradient],
        context: PushContext | None = None,
        *,
        base_versions: Mapping[str, int] | Sequence[int] | None = None,
        shm_buffer: Any = None,
        compression: str | Mapping[str, str] | None = None,
        **fields: Any,
    ) -> PushReply:
        """Pushes gradients of several variables in one RPC, applied exactly once.

        Args:
            grads: :class:`~psflow.ps.push_types.Gradient` items (each with its
                base version), or the short form ``{name: dense_array}`` /
                ``{name: (indices, rows)}`` for sparse.
            context: the request context as the caller built it (a session's,
                passed on as is); else built from ``fields``, the fields of
                :class:`~psflow.ps.push_types.PushContext`: ``push_id``
                (``(client_id, sequence)`` or a sequence number of this client;
                default a fresh one: a retry with the same id is applied once),
                ``step`` and ``num_required`` (synchronous aggregation: the PS
                applies the mean of ``num_required`` contributions to ``step``
                once), ``wait_applied``, ``max_staleness``, ``timeout`` (the
                call's deadline, and how long the PS may hold it), ``rule_json``
                (the update rule the PS applies them with; ``""``: the variables' own).
            base_versions: the versions the short form's gradients were computed from.
            shm_buffer: a :class:`psflow.transport.shm.PayloadBuffer`: the bytes go
                through this shared-memory segment (a PS on the same host) and the
                RPC carries only the header.
            compression: a codec name (``"fp16"``, ``"bf16"``, ``"none"``) for every
                dense gradient, or ``{name: codec}``; the PS decodes before applying.
                Values given as :class:`psflow.compression.Encoded` (from an
                :class:`~psflow.compression.ErrorFeedback`) travel as encoded.

        Raises:
            InvalidArgumentError: an unknown codec name, or a codec for a
                non-float or sparse gradient (nothing is sent).
            AbortedError: a contribution to a step already applied, or too stale.
        """
        context = context or self._context(**fields)
        items = messages.as_gradients(grads, base_versions)
        header, arrays = messages.encode_push(items, context, compression, shm_buffer)
        return self._push(self._push_call(header, arrays), context.timeout)

    def _context(
        self,
        push_id: tuple[str, int] | int | None = None,
        num_required: int | None = None,
        **fields: Any,
    ) -> PushContext:
        if push_id is None:
            push_id = self.next_request_id()
        elif isinstance(push_id, int):
            push_id = (self.client_id, push_id)
        return PushContext(push_id, num_required=int(num_required or 0), **fields)

    def _push_call(self, header: bytes, arrays: list[np.ndarray]) -> Call:
        """A push's message, on the data plane or as a stream or one unary gRPC call."""
        views, total = [framing.byte_view(a) for a in arrays], sum(a.nbytes for a in arrays)
        return Call(
            "Push", header, views, total, _push_reply,
            lambda left: messages.push_reply(self._framed("Push", header, arrays, left)),
        )  # fmt: skip

    def _push(self, call: Call, timeout: float | None) -> PushReply:
        """Sends a push with retries."""
        return self._run("Push", lambda left: self._end.attempt(call, left), timeout)

    def start_push(
        self,
        grads: Mapping[str, Any] | Sequence[Gradient],
        context: PushContext | None = None,
        *,
        shm_buffer: Any = None,
        **fields: Any,
    ) -> Started | None:
        """Sends :meth:`push`'s request on the data plane now and returns without
        reading the reply: its ``result()`` reads it (and makes the push again,
        with the same id, where that attempt failed).  A caller that starts
        pushes to several tasks before it reads any reply has them apply at
        once with no thread of its own per push.  ``context``, or ``fields``
        (:meth:`push`'s ``push_id`` to ``rule_json``), as :meth:`push`'s.

        Returns None, having sent nothing, where the push cannot go that way: no
        data plane known yet (the first call asks for it) or none, or a payload
        above its limit; :meth:`push` makes it then.

        Raises:
            InvalidArgumentError: as :meth:`push` (nothing is sent).
        """
        link = self._end.link
        plane = link.known
        if plane is None or self._end.closed:
            return None
        context = context or self._context(**fields)
        items = messages.as_gradients(grads, None) if isinstance(grads, Mapping) else grads
        header, arrays = messages.encode_push(items, context, None, shm_buffer)
        if sum(a.nbytes for a in arrays) > link.max_payload:
            return None
        timeout = self.timeout if context.timeout is None else context.timeout
        recover = link.recovery(
            plane, "Push", timeout,
            lambda left: self._push(self._push_call(header, arrays), left),
            (UnavailableError, DeadlineExceededError),
        )  # fmt: skip
        views = [framing.byte_view(a) for a in arrays]
        return plane.send("Push", header, views, timeout, read=_push_reply, recover=recover)

    def push_async(self, grads: Mapping[str, Any], **kwargs: Any) -> concurrent.futures.Future:
        """:meth:`push` on the client's thread pool; returns a future (its push id
        is drawn now: the ids follow the order of the calls)."""
        kwargs.setdefault("push_id", self.next_request_id())
        return self.submit(self.push, grads, **kwargs)

    # -- resizing ------------------------------------------------------------------------
    def export_shard(self, names: Sequence[str], *, timeout: float | None = None) -> bytes:
        """A copy of variables with slots, versions and push records (changes nothing)."""
        request = ps_pb2.ExportShardRequest(names=list(names))

        def attempt(left: float) -> bytes:
            return b"".join(m.state for m in self._stubs["ExportShard"](request, timeout=left))

        return self._run("ExportShard", attempt, timeout)

    def import_shard(
        self, state: bytes, placement_version: int, *, timeout: float | None = None
    ) -> list[str]:
        """Installs variables exported by another task; returns their names."""
        view = memoryview(state)

        def messages() -> Iterator[ps_pb2.ImportShardRequest]:
            for start in range(0, max(len(view), 1), self.chunk_bytes):
                chunk = bytes(view[start : start + self.chunk_bytes])
                yield ps_pb2.ImportShardRequest(state=chunk, placement_version=placement_version)

        def attempt(left: float) -> Any:
            return self._stubs["ImportShard"](messages(), timeout=left)

        return list(self._run("ImportShard", attempt, timeout).names)

    def release_shard(
        self,
        names: Sequence[str],
        owner: int,
        owner_address: str,
        placement_version: int,
        *,
        cancel: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Gives variables up to task ``owner``: requests naming them get ``MovedError``.

        ``cancel``: the move was abandoned instead; writes to them are served again.
        """
        request = ps_pb2.ReleaseShardRequest(
            names=list(names),
            owner=owner,
            owner_address=owner_address,
            placement_version=placement_version,
            cancel=cancel,
        )
        self._unary("ReleaseShard", request, timeout)

    def drain(self, *, timeout: float | None = None) -> None:
        """Tells a task that holds nothing to exit (it prints ``PSFLOW_DRAINED``, code 0)."""
        self._unary("Drain", ps_pb2.DrainRequest(), timeout)

    def list_variables(self, *, timeout: float | None = None) -> list[VariableDescription]:
        """Every variable of the task, sorted by name."""
        reply = self._unary("ListVariables", ps_pb2.ListVariablesRequest(), timeout)
        out = messages.variable_descriptions(reply)
        for d in out:
            self._seen(d.name, d.dtype, d.shape)
        return out

    def save(
        self, directory: str, *, prefix: str = "", step: int = 0, timeout: float | None = None
    ) -> dict[str, Any]:
        """Checkpoints the task's shard (a directory on the PS's filesystem)."""
        reply = self._unary(
            "Save", ps_pb2.SaveRequest(directory=directory, prefix=prefix, step=step), timeout
        )
        return {
            "manifest_path": reply.manifest_path,
            "bytes_written": reply.bytes_written,
            "names": list(reply.names),
        }

    def restore(
        self,
        directory: str,
        *,
        prefix: str = "",
        names: Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Replaces the shard by a checkpoint's (``names``: gather these from any shard)."""
        reply = self._unary(
            "Restore",
            ps_pb2.RestoreRequest(directory=directory, prefix=prefix, names=list(names or [])),
            timeout,
        )
        self._specs.clear()
        return {"step": reply.step, "names": list(reply.names)}

    def stats(self, *, include_log: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """The PS counters (bytes, pushes, rejections, staleness, optional log)."""
        reply = self._unary("GetStats", ps_pb2.GetStatsRequest(include_log=include_log), timeout)
        return messages.stats_from_reply(reply, include_log)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The standard health status name (``"SERVING"``, ``"NOT_SERVING"``...)."""
        from grpc_health.v1 import health_pb2

        response = health_pb2.HealthCheckResponse
        check = self._end.stub("/grpc.health.v1.Health/Check", response.FromString)
        request = health_pb2.HealthCheckRequest(service=service)
        reply = self._run("Health.Check", lambda left: check(request, timeout=left), timeout)
        return response.ServingStatus.Name(reply.status)

    def wait_ready(self, timeout: float = 30.0, poll: float = 0.05) -> None:
        """Waits until the task reports SERVING.

        Raises:
            DeadlineExceededError: not SERVING within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        status = "UNKNOWN"
        while time.monotonic() < deadline:
            try:
                status = self.health(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            except OpError as e:
                status = type(e).__name__
            if status == "SERVING":
                return
            time.sleep(poll)
        raise DeadlineExceededError(
            f"{self.task} at {self.address} not SERVING after {timeout}s (last: {status})",
            task=self.task,
        )


def _push_reply(reply: tuple[bytes, memoryview]) -> PushReply:
    """A push's reply on the data plane (a ``PushResponse`` header, no payload)."""
    return messages.push_reply(ps_pb2.PushResponse.FromString(reply[0]))
