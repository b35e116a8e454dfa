"""A process's session with the parameter servers: handles, step cache, pushes.

One session per process and strategy. During a training step (a closure on a
worker) the first read of any variable pulls every small variable the session
knows in one call per PS task, in parallel, and later reads hit that cache;
``apply_gradients`` pushes all gradients in one call per PS task and clears
the cache. Outside a step every read pulls afresh.

An async step begun with ``push_behind`` (a worker's closures, by default)
hands its push to a thread and returns: the worker computes its next step
while the push is on the wire (see :mod:`psflow.distribute.ps.push_behind`
for the staleness of one step this allows, and what it keeps).

Large variables (above ``PREFETCH_LIMIT_BYTES``) and embedding tables are not
prefetched: a dense read pulls them alone, and ``embedding_lookup`` pulls only
the rows a batch uses and pushes back only their gradients.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.distribute.protocols import DistributedValues, UpdateGroup
from psflow.distribute.ps import recovery
from psflow.distribute.ps.connection import PSConnection, VarSpec
from psflow.distribute.ps.placement import PlacementMap
from psflow.distribute.ps.push_behind import PushesBehind
from psflow.distribute.ps.routing import Routing
from psflow.framework.indexed_slices import IndexedSlices
from psflow.framework.tensor import to_array
from psflow.ps.push_types import Gradient, PushContext
from psflow.transport.started import Started, fan_out, gather

PREFETCH_LIMIT_BYTES = 16 << 20
MAX_SCOPES = 64
"""Functions whose read sets a session keeps (the least recently run is forgotten first)."""

log = logging.getLogger("psflow.distribute")

_local = threading.local()
_default: list[PSSession | None] = [None]


def current() -> PSSession:
    """The session of this thread (a worker's closure), else the process default.

    Raises:
        FailedPreconditionError: no ParameterServerStrategy is set up in this process.
    """
    session = getattr(_local, "session", None) or _default[0]
    if session is None:
        raise errors.FailedPreconditionError(
            "No parameter-server session in this process: create a ParameterServerStrategy first"
        )
    return session


@contextlib.contextmanager
def using(session: PSSession) -> Iterator[PSSession]:
    """Makes ``session`` current in this thread (workers run closures inside this)."""
    prev = getattr(_local, "session", None)
    _local.session = session
    try:
        yield session
    finally:
        _local.session = prev


def set_default(session: PSSession | None) -> None:
    """Makes ``session`` the process default (the chief's)."""
    _default[0] = session


@dataclasses.dataclass(frozen=True)
class TrainingMode:
    """What a chief's closure tells the worker that runs it: how its pushes are applied.

    ``compression``: the push codec of dense gradients (a name, or variable name ->
    name; see :mod:`psflow.compression`), or None.
    """

    sync: SyncConfig
    compression: str | Mapping[str, str] | None = None


class SyncConfig:
    """How pushes are applied: ``async``, ``sync`` (mean of one push per worker per step).

    ``timeout``: seconds a synchronous step waits for every worker's gradient
    (finite); ``progress_every``: seconds between the lines a push waiting at
    that barrier logs.
    """

    def __init__(
        self,
        mode: str = "async",
        num_workers: int = 1,
        timeout: float = 300.0,
        progress_every: float = recovery.DEFAULT_PROGRESS_INTERVAL,
    ) -> None:
        if mode not in ("async", "sync", "bounded"):
            raise errors.InvalidArgumentError(
                f"Unknown training mode {mode!r}; expected async, sync or bounded"
            )
        if not 0 < timeout < float("inf"):
            raise errors.InvalidArgumentError(
                f"sync timeout {timeout!r} must be a finite number of seconds > 0"
            )
        self.mode = mode
        self.num_workers = num_workers
        self.timeout = timeout
        # a push held at a sync barrier says so this often (seconds)
        self.progress_every = progress_every


class PSSession(UpdateGroup, Routing):
    """Connections to every PS task and the state of this process's reads and pushes.

    Args:
        connections: one per PS task, in task order.
        sync: the training mode.
        task: this process's task (``"worker:1"``, ``"chief:0"``), for messages.
        connect: ``connect(address, task_index) -> PSConnection``, how a task
            added by a resize is reached (None: this session cannot follow resizes).
    """

    def __init__(
        self,
        connections: Sequence[PSConnection],
        sync: SyncConfig | None = None,
        task: str = "chief:0",
        connect: Callable[[str, int], PSConnection] | None = None,
    ) -> None:
        if not connections:
            raise errors.InvalidArgumentError(
                "A parameter-server session needs at least one PS task"
            )
        self.connections = list(connections)
        self.sync = sync or SyncConfig()
        self.task = task
        self.client_id = f"{task}-{uuid.uuid4().hex[:12]}"
        self._seq: dict[int, Iterator[int]] = {}
        self._connect = connect
        # who holds what; version 0 until the first resize (see placement.py)
        self._placement_lock = threading.RLock()
        self.placement = PlacementMap(0, {}, tuple(c.address for c in self.connections))
        # why this session's variables cannot be moved (see refuse_resize)
        self.resize_blockers: set[str] = set()
        # what a resize moves besides the variables (see on_resize)
        self.resize_steps: list[Callable[[Sequence[str], float], None]] = []
        # the task count an unfinished resize started from (None: none unfinished)
        self.resize_origin: int | None = None
        self._handles: dict[str, Any] = {}
        self._handles_lock = threading.Lock()
        # handles a prefetch found missing on their PS (a restore dropped another
        # model's variables): left out of prefetches until read, or registered, again
        self._gone: set[str] = set()
        self._cache: dict[tuple[str, Any], tuple[Any, int]] | None = None
        self._versions: dict[str, int] = {}
        self._cache_lock = threading.RLock()
        self._step: int | None = None
        self._closure: tuple[str, dict[int, int]] | None = None
        # what each recent function (a worker's closure function, by key) read in its
        # steps: a step prefetches only that, so a worker that served another model
        # before stops pulling that model's variables (see begin_step)
        self._scopes: collections.OrderedDict[str, set[str]] = collections.OrderedDict()
        self._scope: str | None = None
        self._reads: set[str] = set()
        self._dirty_metrics: dict[int, Any] = {}
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(
                max_workers=len(self.connections), thread_name_prefix="ps-call"
            )
            if len(self.connections) > 1
            else None
        )
        self.bytes_pulled = 0
        self.bytes_pushed = 0
        # (rule, its JSON): a constant rate is serialized once, not per push
        self._rule_json: tuple[Any, str] = (None, "")
        # the ParameterServerStrategy this session serves, set by that strategy
        self.strategy: Any = None
        self._watch = recovery.WaitWatch(self.sync.progress_every, log)
        # the current step's pushes in flight (async steps begun with push_behind)
        self._behind = False
        self._pushes = PushesBehind(task)
        # (scope, pull queued behind the last push-behind step's push): its read set for
        # the next step; and the one the running step may start from (see begin_step)
        self._ahead: tuple[str, concurrent.futures.Future] | None = None
        self._ahead_ready: concurrent.futures.Future | None = None
        self._pulls_ahead = False  # the running step pulls ahead for the next

    # -- plumbing ----------------------------------------------------------------------
    def request_id(self, ps: int) -> tuple[str, int]:
        """The id of the next write to PS task ``ps`` (any service on it).

        Inside a closure it derives from the closure, so the same write of a
        closure re-run on another worker carries the same id and is applied once.
        """
        return self._next_id(ps)

    def _next_id(self, ps: int) -> tuple[str, int]:
        """A request id; inside a closure it derives from the closure, so a re-run is deduplicated."""
        closure = self._closure
        if closure is not None:
            key, counters = closure
            counters[ps] = counters.get(ps, 0) + 1
            return (f"{key}/ps{ps}", counters[ps])
        if ps not in self._seq:
            self._seq[ps] = itertools.count(1)
        return (self.client_id, next(self._seq[ps]))

    def _push_id(self) -> tuple[str, int]:
        """The id of one ``apply_gradients``: the same on every PS task it reaches.

        It does not name a task, so when a variable moves with its push records
        a re-run of the same closure is recognised at the variable's new owner.
        """
        closure = self._closure
        if closure is not None:
            key, counters = closure
            counters["push"] = counters.get("push", 0) + 1
            return (f"{key}/push", counters["push"])
        if "push" not in self._seq:
            self._seq["push"] = itertools.count(1)
        return (f"{self.client_id}/push", next(self._seq["push"]))

    def _on_each(self, work: dict[int, Callable[[], Any]]) -> dict[int, Any]:
        """Runs one call per PS task, concurrently when there are several (the
        pool's; the first on this thread), under
        :func:`~psflow.transport.started.gather`'s rule: every call finishes
        before the first error propagates."""
        out = gather(fan_out({}, work, self._pool))
        return {ps: out[ps] for ps in work}

    def close(self) -> None:
        """Closes every connection and the call pool."""
        self._pushes.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._watch.close()
        for c in self.connections:
            c.close()

    # -- handles -----------------------------------------------------------------------
    def register(self, handle: Any) -> Any:
        """Keeps one handle object per PS variable (so tapes and models share it)."""
        with self._handles_lock:
            existing = self._handles.get(handle.key)
            if existing is not None and handle.key not in self._gone:
                return existing
            # new, or the PS lost the old one: a variable created again takes its place
            self._gone.discard(handle.key)
            self._handles[handle.key] = handle
            return handle

    def handle(self, key: str) -> Any:
        """The handle of a PS variable this session knows."""
        return self._handles[key]

    def create(self, handles: Sequence[Any], values: Sequence[np.ndarray]) -> None:
        """Creates variables on their PS tasks (grouped per task, in parallel)."""
        by_ps: dict[int, list[tuple[Any, np.ndarray]]] = {}
        for h, v in zip(handles, values):
            by_ps.setdefault(h.ps_index, []).append((h, v))
        work = {
            ps: (
                lambda items=items, ps=ps: self.connections[ps].create(
                    [
                        VarSpec(h.key, np.dtype(h.np_dtype), tuple(h.shape_tuple), h.trainable)
                        for h, _ in items
                    ],
                    [v for _, v in items],
                )
            )
            for ps, items in by_ps.items()
        }
        results = self._on_each(work)
        for ps, versions in results.items():
            for (h, _), version in zip(by_ps[ps], versions):
                self._versions[h.key] = version
        self.place({h.key: h.ps_index for h in handles})
        for h in handles:
            self.register(h)

    # -- steps -------------------------------------------------------------------------
    def begin_step(
        self,
        step: int | None = None,
        closure_key: str | None = None,
        scope: str | None = None,
        *,
        push_behind: bool = False,
        pull_ahead: bool = False,
    ) -> None:
        """Starts a training step: reads are cached until :meth:`end_step`.

        ``closure_key`` names the closure being run (coordinator session and
        closure id): its pushes carry ids derived from it, so a closure re-run
        on another worker after a failure is applied at most once.  ``scope``
        names the function the step runs: its first read prefetches only what
        that function's earlier steps read (everything known, the first time),
        so the variables of a function no longer run are no longer pulled.
        ``push_behind`` (async mode only; ignored otherwise): the step's pushes
        run behind it (:mod:`~psflow.distribute.ps.push_behind`); the caller
        takes them with :meth:`detach_pushes` before :meth:`end_step`, else
        ``end_step`` waits for them.  ``pull_ahead`` (with ``push_behind``; the
        caller says this step follows the one before with nothing in between):
        the step starts from the values the step before pulled for it, when it
        runs the same function, and pulls ahead for the next step itself.
        """
        self._pushes.wait()  # a step begun elsewhere (not through step()) left some
        with self._cache_lock:
            self._cache = {}
            self._behind = push_behind and self.sync.mode == "async"
            ahead, self._ahead = self._ahead, None
            # only a step that itself followed another pulls ahead: closures that come one
            # at a time (a join after each) would pull every step twice for nothing
            self._pulls_ahead = pull_ahead and self._behind and scope is not None
            usable = self._pulls_ahead and ahead is not None and ahead[0] == scope
            self._ahead_ready = ahead[1] if usable and ahead is not None else None
            self._step = step
            self._closure = (closure_key, {}) if closure_key else None
            self._scope = scope
            self._reads = set()

    def detach_pushes(self) -> Started:
        """Takes the running step's pushes in flight: ``result()`` waits for them
        and raises the first one's error (the step is done once it returns)."""
        return self._pushes.detach()

    def end_step(self) -> None:
        """Ends the step: metrics updated in it are flushed, its pushes still in
        flight waited for; reads pull afresh again."""
        with self._cache_lock:
            dirty = list(self._dirty_metrics.values())
            self._dirty_metrics.clear()
        try:
            try:
                for metric in dirty:
                    metric._ps.flush(metric)
            finally:
                self._pushes.wait()
        finally:
            with self._cache_lock:
                self._behind = self._pulls_ahead = False
                self._ahead_ready = None
                self._cache = None
                self._step = None
                self._closure = None
                scope, self._scope = self._scope, None
                if scope is not None:
                    self._scopes.setdefault(scope, set()).update(self._reads)
                    self._scopes.move_to_end(scope)
                    while len(self._scopes) > MAX_SCOPES:
                        self._scopes.popitem(last=False)

    def defer_flush(self, metric: Any) -> bool:
        """Remembers a metric to flush when the running step ends; False outside a step."""
        with self._cache_lock:
            if self._cache is None:
                return False
            self._dirty_metrics[id(metric)] = metric
            return True

    @contextlib.contextmanager
    def step(
        self,
        step: int | None = None,
        closure_key: str | None = None,
        scope: str | None = None,
        *,
        push_behind: bool = False,
        pull_ahead: bool = False,
    ) -> Iterator[None]:
        """``begin_step`` ... ``end_step``."""
        self.begin_step(step, closure_key, scope, push_behind=push_behind, pull_ahead=pull_ahead)
        try:
            yield
        finally:
            self.end_step()

    # -- reads -------------------------------------------------------------------------
    def _prefetchable(self, h: Any) -> bool:
        return not h.sparse_access and h.nbytes <= PREFETCH_LIMIT_BYTES

    def _pull_into_cache(self, handles: Sequence[Any]) -> dict[str, tuple[np.ndarray, int]]:
        def pull(ps: int, hs: list[Any], attempt: int) -> Any:
            return self.connections[ps].pull([h.key for h in hs])

        def start(ps: int, hs: list[Any], attempt: int) -> Any:
            return self.connections[ps].start_pull([h.key for h in hs])

        # each owner's pull sent at once, its reply read here (``_answers``); what the
        # data plane cannot start, or a task redirects, goes the general way
        with self._starting(handles) as (by_ps, calls):
            for ps, hs in by_ps.items():
                calls[ps] = start(ps, hs, 0)
        out: dict[str, tuple[np.ndarray, int]] = {}
        for hs, pulled in self._answers(calls, by_ps, pull, start):
            for h, (value, version) in zip(hs, pulled):
                out[h.key] = (value, version)
                self.bytes_pulled += value.nbytes
        return out

    def _settle(self, key: str) -> None:
        """Waits for the step's pushes in flight when one writes ``key`` (then pulls afresh)."""
        if self._pushes.pending and self._pushes.touches(key):
            self._pushes.wait()
            self._invalidate()

    def read(self, handle: Any) -> Any:
        """The value of a PS variable on the current device (cached inside a step)."""
        self._settle(handle.key)
        dev = backend.current_device()
        with self._cache_lock:
            cache = self._cache
            if cache is None:
                value, version = self._pull_into_cache([handle])[handle.key]
                self._versions[handle.key] = version
                return backend.place(value, dev) if dev.is_gpu else value
            self._reads.add(handle.key)
            hit = cache.get((handle.key, dev))
            if hit is not None:
                return hit[0]
            host = cache.get((handle.key, None))
            if host is None:
                pulled = self._take_ahead(handle)
                if pulled is None:
                    others = []
                    if self._prefetchable(handle):
                        known = self._scopes.get(self._scope) if self._scope is not None else None
                        others = [
                            h
                            for k, h in self._handles.items()
                            if k != handle.key
                            and (known is None or k in known)
                            and (k, None) not in cache
                            and k not in self._gone
                            and self._prefetchable(h)
                        ]
                    try:  # one pull of them all (see _probe_gone for a NotFound)
                        pulled = self._pull_into_cache([handle, *others])
                    except errors.NotFoundError:
                        if not others:
                            raise
                        pulled = self._probe_gone(handle, others)
                    if handle.key in self._gone:  # read again: it exists (again)
                        with self._handles_lock:
                            self._gone.discard(handle.key)
                    if self._prefetchable(handle):
                        self._pull_ahead([handle, *others])
                for key, (value, version) in pulled.items():
                    if (key, None) not in cache:
                        cache[(key, None)] = (value, version)
                        self._versions[key] = version
                host = cache[(handle.key, None)]
            if not dev.is_gpu:
                return host[0]
            placed = backend.place(host[0], dev)
            cache[(handle.key, dev)] = (placed, host[1])
            return placed

    def _take_ahead(self, handle: Any) -> dict[str, tuple[np.ndarray, int]] | None:
        """What the step before pulled ahead for this one, if it holds ``handle`` (cache lock
        held); it then pulls ahead for the next step.  None: pull now (no pull ahead, or
        it failed: the pull now meets the same fault, if it lasts, and raises it)."""
        ready, self._ahead_ready = self._ahead_ready, None
        if ready is None:
            return None
        try:
            pulled = ready.result()
        except Exception as e:  # pulled again now, where a lasting fault is raised
            log.debug("%s: the pull ahead failed (%s); pulling now", self.task, e)
            return None
        if handle.key not in pulled:
            return None
        # ahead for the next step: what this function's steps read, where known (a new
        # function's first step pulled every variable; carried on, every later step would)
        known = self._scopes.get(self._scope) if self._scope is not None else None
        self._pull_ahead(
            [
                self._handles[k]
                for k in pulled
                if k in self._handles and (known is None or k in known or k == handle.key)
            ]
        )
        return pulled

    def _pull_ahead(self, handles: list[Any]) -> None:
        """Queues a pull of ``handles`` for the next step behind this step's pushes (cache
        lock held; steps begun with ``pull_ahead`` only)."""
        if self._pulls_ahead and handles:
            pull = functools.partial(self._pull_into_cache, handles)
            self._ahead = (self._scope, self._pushes.queue(pull))

    def _probe_gone(self, handle: Any, others: list[Any]) -> dict[str, tuple[np.ndarray, int]]:
        """``handle``'s value and those of ``others`` where a step's first read, pulling
        them all, met a NotFound.

        Such a NotFound caused by one of ``others`` is no failure of this read: a
        restore may have dropped variables another model (an earlier function
        this worker ran) left in this session.  Those are probed one by one,
        the missing ones left out of later prefetches, and the rest kept.

        Raises:
            NotFoundError: ``handle`` itself is missing on its PS task.
        """
        out = self._pull_into_cache([handle])  # its own NotFound is the caller's error
        missing = []
        for h in others:  # bounded: once per variable, and only after such a restore
            try:
                out.update(self._pull_into_cache([h]))
            except errors.NotFoundError:
                missing.append(h.key)
        with self._handles_lock:
            self._gone.update(missing)
        log.info(
            "%s: %d variables are gone from the parameter servers (e.g. %s); no longer prefetched",
            self.task,
            len(missing),
            missing[:3],
        )
        return out

    def read_rows(self, handle: Any, indices: np.ndarray) -> np.ndarray:
        """Rows of a PS variable (no caching: each lookup pulls only what it needs)."""
        self._settle(handle.key)

        def pull(ps: int, hs: list[Any], attempt: int) -> Any:
            return self.connections[ps].pull([handle.key], rows={0: indices})

        ((_, ((rows, version),)),) = self._routed([handle], pull).values()
        self.bytes_pulled += rows.nbytes + indices.nbytes
        self._versions.setdefault(handle.key, version)
        return rows

    # -- writes ------------------------------------------------------------------------
    def write(self, handle: Any, op: str, value: Any) -> None:
        """``assign`` / ``assign_add`` / ``assign_sub`` on the PS (exactly once)."""
        self._settle(handle.key)
        arr = backend.to_contiguous_numpy(to_array(value).astype(handle.np_dtype, copy=False))

        def write(ps: int, hs: list[Any], attempt: int) -> Any:
            # a redirected write was applied nowhere: a fresh id at its new owner
            return self.connections[ps].write(op, [handle.key], [arr], request_id=self._next_id(ps))

        ((_, (version,)),) = self._routed([handle], write).values()
        self._versions[handle.key] = version
        self._invalidate()

    def _invalidate(self) -> None:
        with self._cache_lock:
            if self._cache is not None:
                self._cache = {}

    # -- optimizer updates ---------------------------------------------------------------
    def _rule_text(self, rule: Any) -> str:
        """``rule``'s config as canonical JSON, kept while the optimizer returns the same rule."""
        held, text = self._rule_json
        if held is not rule:
            text = json.dumps(rule.get_config(), sort_keys=True)
            self._rule_json = (rule, text)
        return text

    def apply_optimizer(self, optimizer: Any, pairs: Sequence[tuple[Any, Any]], step: int) -> None:
        """Pushes ``(gradient, variable)`` pairs; each PS applies ``optimizer``'s rule."""
        rule_json = self._rule_text(optimizer.rule)  # the rate at this step: pushes carry it
        grads: dict[str, Gradient] = {}
        handles: list[Any] = []
        for grad, var in pairs:
            if isinstance(grad, DistributedValues):
                grad = grad.values[0]  # already all-reduced: every replica holds the same
            h = var
            if isinstance(grad, IndexedSlices):
                values = backend.to_numpy(grad._values).astype(h.np_dtype, copy=False)
                indices = backend.to_numpy(grad._indices).astype(np.int64, copy=False).reshape(-1)
                g = Gradient(
                    h.key,
                    backend.to_contiguous_numpy(values.reshape((indices.size, *h.shape_tuple[1:]))),
                    indices,
                    self._versions.get(h.key, -1),
                )
            else:
                values = backend.to_numpy(to_array(grad)).astype(h.np_dtype, copy=False)
                g = Gradient(
                    h.key, backend.to_contiguous_numpy(values), None, self._versions.get(h.key, -1)
                )
            grads[h.key] = g
            handles.append(h)
        sync = self.sync.mode == "sync"
        step_id = self._step if sync else None
        if sync and step_id is None:
            raise errors.FailedPreconditionError(
                "Synchronous training applies gradients only inside scheduled closures "
                "(coordinator.schedule or model.fit)"
            )

        push_id = self._push_id()

        def context(attempt: int) -> PushContext:
            # the first try carries the step's id; a redirected resend, applied nowhere
            # yet, one of its own (the new owner may have had this id for other variables)
            return PushContext(
                push_id=push_id if attempt == 0 else (f"{push_id[0]}/moved{attempt}", push_id[1]),
                step=step_id,
                num_required=self.sync.num_workers if sync else 0,
                wait_applied=sync,
                timeout=self.sync.timeout if sync else None,
                rule_json=rule_json,
            )

        def start(ps: int, hs: list[Any], attempt: int) -> Any:
            if sync:  # a sync push waits at the barrier, watched: on the pool
                return None
            return self.connections[ps].start_push([grads[h.key] for h in hs], context(attempt))

        def push(ps: int, hs: list[Any], attempt: int) -> Any:
            call = functools.partial(
                self.connections[ps].push, [grads[h.key] for h in hs], context(attempt)
            )
            if not sync:
                return call()
            # held at the PS until every worker's gradient of this step arrived: say so
            what = (
                f"{self.task} waits at the barrier of sync step {step_id} on "
                f"{self.connections[ps].task} for {self.sync.num_workers} workers' gradients"
            )
            with self._watch.waiting(what, self.sync.timeout):
                return call()

        pushed = sum(
            g.values.nbytes + (g.indices.nbytes if g.indices is not None else 0)
            for g in grads.values()
        )

        def send() -> None:
            self._routed(handles, push, start)
            self.bytes_pushed += pushed

        if self._behind and not sync:
            # the step goes on (and ends); its reads of these variables wait for the push.
            # The versions of the reply are not kept: the next step's reads set them, and
            # its gradients must carry the versions they were computed from
            self._pushes.submit(grads, send)
            return
        # routed here: each owner's push sent at once, no wrapper per call.  What the data
        # plane cannot start (a sync push, no plane known yet) and what a task answers
        # with a redirect take the general route, ``_routed``; every call sent finishes
        # before an error propagates (``gather``'s rule)
        with self._starting(handles) as (by_ps, calls):
            for ps, hs in by_ps.items():
                calls[ps] = (
                    None  # a sync push waits at the barrier, watched: on the pool
                    if sync
                    else self.connections[ps].start_push([grads[h.key] for h in hs], context(0))
                )
        replies = self._answers(calls, by_ps, push, start)
        self.bytes_pushed += pushed
        for hs, reply in replies:
            for h, version in zip(hs, reply.versions):
                self._versions[h.key] = version
        self._invalidate()

    # -- whole-cluster operations --------------------------------------------------------
    def save(self, directory: str, step: int = 0) -> list[str]:
        """Every PS task writes its shard under ``directory``; returns the manifests."""
        results = self._on_each(
            {
                ps: (lambda ps=ps, c=c: c.save(directory, step, prefix=f"ps-{ps}"))
                for ps, c in enumerate(self.connections)
            }
        )
        return [results[ps] for ps in sorted(results)]

    def restore(
        self, directory: str, names_per_ps: dict[int, list[str]] | None = None, prefix: str = "ps"
    ) -> int:
        """Every PS task replaces its shard from ``directory``; returns the checkpoint's step.

        With ``names_per_ps`` each task restores exactly those variables,
        gathered from any shard file (the checkpoint may come from another
        number of tasks); otherwise task ``i`` restores ``{prefix}-{i}``.
        """
        work = {
            ps: (
                lambda ps=ps, c=c: c.restore(
                    directory,
                    prefix=f"{prefix}-{ps}",
                    names=(names_per_ps or {}).get(ps) if names_per_ps is not None else None,
                )
            )
            for ps, c in enumerate(self.connections)
            if names_per_ps is None or (names_per_ps.get(ps))
        }
        steps = self._on_each(work)
        self._invalidate()
        return max(steps.values()) if steps else 0

    def handles_by_ps(self) -> dict[int, list[Any]]:
        """The variable handles this session knows, grouped by PS task."""
        out: dict[int, list[Any]] = {}
        with self._handles_lock:
            for h in self._handles.values():
                out.setdefault(h.ps_index, []).append(h)
        return out

    def wait_ready(
        self,
        timeout: float,
        *,
        probe_timeout: float = recovery.DEFAULT_PROBE_TIMEOUT,
        progress_every: float = recovery.DEFAULT_PROGRESS_INTERVAL,
    ) -> None:
        """Waits until every PS task answers (after a restart), all within ``timeout`` seconds.

        Logs a line naming the task it waits for at once and then every
        ``progress_every`` seconds.  Each probe's deadline is
        ``min(probe_timeout, time left)``: a frozen or partitioned PS cannot
        hold the wait past ``timeout``.

        Raises:
            PSUnavailableError: a task still does not answer after ``timeout``
                seconds (the message and ``.task`` name it).
        """
        deadline = time.monotonic() + timeout
        for c in self.connections:
            progress = recovery.Progress(
                f"{self.task} waits for parameter server {c.task} to answer again",
                timeout,
                progress_every,
                log,
            )
            recovery.wait_until(c.task, c.probe, deadline, progress, probe_timeout)
            if progress.lines:
                log.warning("%s: %s answers again", self.task, c.task)

    def stats(self, include_log: bool = False) -> list[dict[str, Any]]:
        """Every PS task's counters."""
        results = self._on_each(
            {ps: (lambda c=c: c.stats(include_log)) for ps, c in enumerate(self.connections)}
        )
        return [results[ps] for ps in sorted(results)]


def adopt_placement(placement: PlacementMap) -> None:
    """Makes this process's session take ``placement`` (a closure the chief sends after a resize)."""
    current().adopt(placement)
