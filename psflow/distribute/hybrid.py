"""Hybrid mode of ``MultiWorkerMirroredStrategy``: dense variables mirrored, tables on the PS.

A cluster spec with ``worker`` (and ``chief``) tasks *and* ``ps`` tasks gives
a multi-worker strategy whose dense variables are mirrored and all-reduced
over the workers' ring, as without PS tasks, while every
:class:`~psflow.keras.layers.DynamicEmbedding` table created in its scope
lives on the PS tasks (hashed over them by id, as under
``ParameterServerStrategy``).  Each worker looks its batch's rows up from
the PS itself.  A step's table gradients travel with the dense ones: the
rows every replica touched are all-gathered over the ring (the sparse path
of :class:`~psflow.distribute.multi_worker_mirrored_strategy.MultiWorkerReplicaContext`:
on CPU devices the dense gradients ride in the same gather, one ring round),
so after the step's collective every worker holds the step's whole sparse
gradient ``G`` (every replica's rows).  The workers then share its push:
worker ``r`` of ``n`` sums per id, and sends, the rows held by the PS tasks
``t`` with ``t % n == r`` (as many workers as PS tasks: worker ``r`` talks
to task ``r`` only; fewer PS tasks than workers: some workers push nothing).

Semantics.  Every PS task gets one push per table per step: the sum over
every replica of its gradient rows, summed per id.  With each replica's
loss scaled by ``1 / global batch`` (``nn.compute_average_loss``), that sum
is the gradient of the global batch's mean loss, so any optimizer (SGD,
Adagrad, Adam, FTRL: applied once, and a table's step count, Adam's bias
correction, advances once per step as in one process) updates a row as one
process on the global batch would, up to the order of float additions (the
rows of one id are summed per replica, then over replicas).  A per-replica
mean loss instead (``reduce_mean``) gives ``num_replicas`` times that
gradient, for the dense variables as much as for the tables.

Exactly once.  A push carries the request id
``("<run>/<table>/a<j>/ps<t>", step + 1)``: the run's id (worker 0's,
broadcast when the strategy starts), the table, the ``j``-th
``apply_gradients`` of the step and the PS task: the same whoever sends it.
The PS applies an id once and answers a repeat with its first reply.

* Without ``elastic``, a lost worker ends the job (as TensorFlow): a worker
  pushes its part right after the step's collective, then the workers pass
  a one-number all-reduce, so no worker looks rows up for the next step
  before every part of this one is applied.
* With ``elastic``, a step's table gradient is pushed only once the step is
  *committed*: once the group's next barrier (every member reached the next
  step boundary) has passed.  A step the group drops and redoes after a
  re-form has therefore pushed nothing, and its redo (other examples,
  another cut) pushes its own gradient once.  A committed step is never
  redone (the group resumes at the smallest completed step of its
  survivors, and every survivor completed it).  Its pushes cannot be lost
  with a worker either: every survivor holds ``G`` and, after a re-form,
  pushes *every* part of the last committed step again with the same ids,
  so the parts the lost worker had pushed are answered from the PS's
  memory and the others are applied now, exactly once.  Rows created by a
  dropped step's lookups stay (a row's initial value depends on its id
  only; ``min_count`` counts such a lookup).  The last step of an epoch is
  committed by the barrier that ends the epoch: iterate the distributed
  dataset to its end (``fit`` does); a loop that stops early leaves its
  last step's table gradient unpushed.
* A worker that joins a running elastic group (a restarted or an added one)
  receives the run id with the group's state (the elastic hand-over's
  ``extra`` values) and names its pushes as the others do.  It is admitted
  at a barrier, after the members pushed the step that barrier committed;
  from the next step on the parts are cut over the new group, and the
  joiner pushes its own part once each step is committed, as any member.

Resizing the PS tasks.  ``strategy.resize_parameter_servers(num_ps)``
(:meth:`HybridTables.resize`), called by every worker at the same step
boundary, moves the tables' rows onto PS tasks ``0..num_ps-1`` of the
cluster as worker 0's resolver lists it then.  The workers pass a barrier
(every member finished its step: an elastic group pushes its staged step
there, which that barrier commits), so no lookup or push is in flight;
worker 0 moves the rows with the PS mode's resize
(:func:`psflow.distribute.ps.resize.resize`: the tables re-shard through
:func:`~psflow.distribute.ps.table_moves.move_tables`, the tasks removed
drain), while the group waits in short broadcasts of its progress (a
resize may take longer than the ring's silence timeout); then the outcome
reaches every worker over the ring, every worker re-points its session and
table client at the new tasks, and the group goes on.  From then on the
parts of a step are cut by the new PS count.  A resize that failed before
any row switched (a PS that never answered) leaves every worker on the old
tasks, with the same typed error on each.

Following the launcher's view.  A worker whose strategy built its resolver
from ``PSFLOW_CLUSTER_FILE`` (``psflow local --mode multi-worker --ps-max N``
sets it; ``psflow scale --ps K`` rewrites the file) resizes by itself: worker
0 looks at the file (a ``stat``, at most every :data:`VIEW_CHECK_SECONDS`)
and, when it changed, puts the PS count it lists into the one-number
collective the step already does (the post-push barrier, or the elastic
commit's), so every worker learns it in the same step; each then calls the
resize at the start of its next ``strategy.run``.  A resize that fails is
logged and training goes on over the old tasks (until the view changes
again).  A job without that variable (``TF_CONFIG`` alone) sends the same
zero it always did and checks no file.

Example (a worker of a cluster with ``worker`` and ``ps`` tasks in ``TF_CONFIG``)::

    strategy = pf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = pf.keras.Sequential([pf.keras.layers.DynamicEmbedding(8),
                                     pf.keras.layers.Flatten(),
                                     pf.keras.layers.Dense(1)])
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.distribute.ps import session as session_lib
from psflow.distribute.values import PerReplica
from psflow.framework.indexed_slices import IndexedSlices
from psflow.ps.key_index import shard_of, sum_rows, unique_ids

__all__ = ["HybridTables", "SparseStep", "TableGradient", "ViewWatch"]

log = logging.getLogger("psflow.distribute")

_RUN_ID_BYTES = 16
# while worker 0 resizes, the group hears from it this often (a one-number broadcast)
_RESIZE_POLL_SECONDS = 0.05
# how long past the resize's own deadline the group waits for worker 0's outcome
_RESIZE_GRACE_SECONDS = 30.0
VIEW_CHECK_SECONDS = 0.5
"""How often, at most, worker 0 looks whether the launcher's cluster file changed."""


class ViewWatch:
    """Worker 0's look at the cluster file a launcher rewrites (see the module docstring).

    Args:
        resolver: a :class:`~psflow.distribute.cluster_resolver.ClusterFileResolver`.
        interval: the least seconds between two looks.
    """

    def __init__(self, resolver: Any, interval: float = VIEW_CHECK_SECONDS) -> None:
        self.resolver = resolver
        self._interval = interval
        self._next = 0.0
        self._key = self._stat()  # the view the strategy started from is no news

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.resolver.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def forget(self) -> None:
        """The next look reports the file's count even if it did not change (after a re-form)."""
        self._key = None
        self._next = 0.0

    def news(self) -> int:
        """The PS count the file lists when it changed since the last look, else 0."""
        now = time.monotonic()
        if now < self._next:
            return 0
        self._next = now + self._interval
        key = self._stat()
        if key is None or key == self._key:
            return 0
        self._key = key
        try:
            spec = self.resolver.refresh()
        except errors.OpError as e:  # a half-edited file by hand: keep the old view
            log.warning("cluster view %s not followed: %s", self.resolver.path, e)
            return 0
        return spec.num_tasks("ps") if "ps" in spec.jobs else 0


def _share(ring: Any, payload: Any) -> Any:
    """Every worker gets worker 0's JSON ``payload`` (the others pass None); None stays None
    after one broadcast (its length, 0), anything else takes a second (its bytes)."""
    raw = None
    if ring.rank == 0 and payload is not None:
        raw = np.frombuffer(json.dumps(payload).encode(), np.uint8)
    (size,) = ring.broadcast([np.array([0 if raw is None else raw.size], np.int64)], root=0)
    if int(size[0]) == 0:
        return None
    (raw,) = ring.broadcast([raw if raw is not None else np.empty(int(size[0]), np.uint8)], 0)
    return json.loads(raw.tobytes().decode())


def _error_payload(error: BaseException) -> dict:
    if isinstance(error, errors.OpError):
        return {"error": int(error.code), "message": str(error)}
    return {"error": int(errors.Code.INTERNAL), "message": f"{type(error).__name__}: {error}"}


@dataclasses.dataclass(frozen=True)
class TableGradient:
    """One table's gradient of one ``apply_gradients``: every replica's rows, as gathered.

    ``ids`` and ``rows`` are the gathered rows (an id may repeat: once per
    replica that touched it); :meth:`part` sums them per id for the PS tasks
    of one part only, so a worker sums the rows it pushes and no others.
    """

    table: str
    apply_index: int
    optimizer: dict
    ids: np.ndarray
    rows: np.ndarray
    client: Any
    # part count -> each gathered row's part (the PS task's index modulo the parts)
    _owners: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def part(self, part: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
        """``(unique ids, their summed rows)`` held by the PS tasks ``t`` with ``t % parts == part``.

        An id's rows all fall in one part, in their gathered order, so its sum
        is the same, bit for bit, as over every part at once.
        """
        ids, rows = self.ids, self.rows
        if parts > 1:
            owner = self._owners.get(parts)
            if owner is None:
                owner = self._owners[parts] = shard_of(ids, self.client.num_shards) % parts
            where = np.flatnonzero(owner == part)
            ids, rows = ids[where], rows[where]
        unique, inverse = unique_ids(ids)
        summed = rows if unique is ids else sum_rows(rows, inverse, unique.size)
        return unique, np.ascontiguousarray(summed)


@dataclasses.dataclass
class SparseStep:
    """The table gradients of one step, cut into ``parts`` (the workers of that step)."""

    step: int
    parts: int
    gradients: list[TableGradient] = dataclasses.field(default_factory=list)


class HybridTables:
    """This worker's PS session, and the table pushes of its steps (see the module doc).

    Args:
        ps_addresses: the PS tasks, in task order.
        task: this worker's name (``"worker:1"``), for messages and request ids.
        timeout: the deadline of each call to a PS task (seconds).
        security: credentials for the PS tasks (default: the environment's).
    """

    def __init__(
        self,
        ps_addresses: Sequence[str],
        task: str,
        timeout: float,
        security: Any = None,
    ) -> None:
        from psflow.distribute.ps.grpc_connection import GrpcPSConnection

        if not ps_addresses:
            raise errors.InvalidArgumentError("hybrid mode needs at least one ps task")
        self.timeout = timeout

        def connect(address: str, index: int) -> Any:
            return GrpcPSConnection(address, task=f"ps:{index}", security=security, timeout=timeout)

        self.session = session_lib.PSSession(
            [connect(a, i) for i, a in enumerate(ps_addresses)],
            session_lib.SyncConfig("async"),
            task=task,
            connect=connect,
        )
        # tables built in the strategy's scope find the PS tasks through this session
        session_lib.set_default(self.session)
        self.run_id = uuid.uuid4().hex[:_RUN_ID_BYTES]
        self._applies = 0  # apply_gradients calls so far (the step key without elastic)
        self._staged: SparseStep | None = None  # elastic: this step's, not yet committed
        self._committed: SparseStep | None = None  # elastic: the last committed step
        self.watch: ViewWatch | None = None  # set when the launcher publishes the view
        self.pending_ps: int | None = None  # the view's PS count, to resize to next step
        self._pending_size = 0  # the group's size when it learned pending_ps

    # -- setup -------------------------------------------------------------------------
    RUN_ID_KEY = "hybrid_run_id"  # the run id's key in the elastic state's extra values
    PS_KEY = "hybrid_ps"  # the PS tasks after a resize, in the elastic state's extra values

    def take_run_id(self, state: Any) -> None:
        """A joiner: takes the group's run id, received with its state (a ``TrainingState``).

        Raises:
            InternalError: the state came without one.
        """
        run_id = state.received_extra.get(self.RUN_ID_KEY)
        if not isinstance(run_id, str) or not run_id:
            raise errors.InternalError(
                f"hybrid mode: the group's state came without its run id "
                f"({self.RUN_ID_KEY!r} in {sorted(state.received_extra)})"
            )
        self.run_id = run_id
        tasks = state.received_extra.get(self.PS_KEY)
        if tasks is not None:  # the group resized its PS tasks since TF_CONFIG was written
            self._repoint(tasks["addresses"], tasks["version"])

    def agree_run_id(self, ring: Any) -> None:
        """Takes worker 0's run id (every worker must call it, once, at the start)."""
        if ring.size > 1:
            mine = np.frombuffer(self.run_id.encode().ljust(_RUN_ID_BYTES), np.uint8).copy()
            (agreed,) = ring.broadcast([mine], root=0)
            self.run_id = bytes(agreed).decode().strip()

    @staticmethod
    def holds(variable: Any) -> bool:
        """Whether ``variable`` is a table on the PS tasks (its updates go through here)."""
        from psflow.keras.layers.dynamic_embedding import DynamicTableHandle

        return isinstance(variable, DynamicTableHandle) and variable._local is None

    # -- a step's gradient -------------------------------------------------------------
    def gradients(self, optimizer: Any, pairs: Iterable[tuple[Any, Any]]) -> list[TableGradient]:
        """Each table's step gradient (every replica's rows, gathered).

        Raises:
            InvalidArgumentError: a dense gradient for a table.
        """
        config = optimizer.rule.get_config()
        out = []
        for j, (grad, handle) in enumerate(pairs):
            if isinstance(grad, PerReplica):  # gathered: every local replica holds the same
                grad = grad.values[0]
            if not isinstance(grad, IndexedSlices):
                raise errors.InvalidArgumentError(
                    f"{handle.name}: a dynamic table takes sparse row gradients, got a dense one"
                )
            ids = np.asarray(backend.to_numpy(grad._indices)).astype(np.int64).reshape(-1)
            values = np.asarray(backend.to_numpy(grad._values)).astype(handle.config.dtype)
            values = values.reshape(ids.size, handle.config.dim)
            # summed per id later, per part (TableGradient.part): only the part pushed
            out.append(
                TableGradient(handle.config.name, j, config, ids, values, handle.backend.client)
            )
        return out

    def push(self, step: SparseStep, parts: Iterable[int]) -> None:
        """Pushes ``parts`` of ``step`` (each id applied once, however often it is pushed).

        Part ``p`` is the rows owned by the PS tasks ``t`` with ``t % step.parts == p``:
        every PS task gets one push per table per step, as from one process.

        Raises:
            UnavailableError / DeadlineExceededError: a PS task is gone (named).
        """
        finishes = []
        for g in step.gradients:
            for part in sorted(set(parts)):
                if part >= step.parts:
                    continue
                ids, rows = g.part(part, step.parts)
                if not ids.size:
                    continue
                name = f"{self.run_id}/{g.table}/a{g.apply_index}"

                def request_id(ps: int, _name: str = name, _seq: int = step.step + 1) -> Any:
                    # the same for a step's push to task ``ps`` whoever sends it
                    return (f"{_name}/ps{ps}", _seq)

                finishes.append(
                    g.client.start_push(
                        g.table, ids, rows, optimizer=g.optimizer, request_ids=request_id
                    )
                )
        for finish in finishes:
            finish()

    # -- the strategy's update ---------------------------------------------------------
    def apply(self, optimizer: Any, pairs: list[tuple[Any, Any]], strategy: Any) -> None:
        """The tables' share of ``apply_gradients`` (called once per worker, cross-replica)."""
        rank, size = strategy._group.rank, strategy._group.size
        controller = strategy._elastic
        gradients = self.gradients(optimizer, pairs)
        if controller is None:
            self._applies += 1
            self.push(SparseStep(self._applies - 1, size, gradients), [rank])
            # nobody looks rows up for the next step before every part is applied;
            # the barrier carries worker 0's news of the cluster view
            self._learn(strategy._ring.all_reduce([self._view_news(rank)]), size)
            return
        step = controller.completed
        staged = self._staged
        if staged is None or staged.step != step:
            staged = self._staged = SparseStep(step, size)
        offset = len(staged.gradients)
        staged.gradients.extend(
            dataclasses.replace(g, apply_index=offset + i) for i, g in enumerate(gradients)
        )

    # -- elastic: commit and re-form ---------------------------------------------------
    def committed(self, completed: int, ring: Any) -> None:
        """The group passed a barrier: every step before ``completed`` is committed.

        Pushes this worker's part of the staged step, then waits with the group
        until every part is applied (a one-number all-reduce).
        """
        staged = self._staged
        if staged is None or staged.step >= completed:
            return
        self.push(staged, [ring.rank])
        self._committed, self._staged = staged, None
        self._learn(ring.all_reduce([self._view_news(ring.rank)]), ring.size)

    # -- following the launcher's view -------------------------------------------------
    def _view_news(self, rank: int) -> np.ndarray:
        """This worker's share of a barrier: worker 0's news of the view, others 0."""
        news = self.watch.news() if self.watch is not None and rank == 0 else 0
        return np.array([news], np.int64)

    def _learn(self, reduced: Sequence[np.ndarray], size: int) -> None:
        """Every worker: the view's PS count from the barrier's sum, kept if it differs."""
        count = int(reduced[0][0])
        if count > 0 and count != len(self.session.connections):
            self.pending_ps, self._pending_size = count, size

    def take_pending(self, size: int) -> int | None:
        """The PS count to resize to now (every worker gets the same), or None.

        ``size``: the group's size now.  A group that admitted a worker since it
        learned the count drops it (the joiner did not learn it); worker 0 reports
        the view again at the next barrier, to every member.
        """
        count, self.pending_ps = self.pending_ps, None
        if count is not None and size != self._pending_size:
            if self.watch is not None:
                self.watch.forget()
            return None
        return count

    def reformed(self, completed: int) -> None:
        """The group re-formed and resumes at step ``completed``.

        Every part of the last committed step is pushed again (the parts a lost
        worker had pushed are answered from the PS's memory, the rest applied
        now); a staged step the group redoes is dropped.
        """
        self.pending_ps = None  # a member may not have learned it: the view is read again
        if self.watch is not None:
            self.watch.forget()
        staged = self._staged
        if staged is not None:
            if staged.step < completed:
                self._committed = staged
            self._staged = None
        last = self._committed
        if last is not None:
            self.push(last, range(last.parts))

    # -- resizing the PS tasks ----------------------------------------------------------
    def settle(self, ring: Any) -> None:
        """A resize's barrier: every worker finished its step, and every part of it is applied.

        An elastic group's staged step is committed by this barrier: its parts
        are pushed here (as the next step boundary would have), and nothing is
        pushed again after a later re-form (every part was applied before the
        rows moved; their records do not move with them).
        """
        ring.all_reduce([np.zeros(1, np.int64)])  # every member finished the step
        staged = self._staged
        if staged is not None:
            self.push(staged, [ring.rank])
            self._staged = None
            ring.all_reduce([np.zeros(1, np.int64)])  # every part applied
        self._committed = None

    def _repoint(self, addresses: Sequence[str], version: int) -> None:
        """This worker's session and table client route by ``addresses`` from now on."""
        from psflow.keras.layers import dynamic_embedding

        session = self.session
        if list(addresses) != [c.address for c in session.connections]:
            session.adopt_tasks(list(addresses), version=version)
        elif session.placement.version != version:
            session.announce_tasks(list(addresses), version)
        found = dynamic_embedding._by_session.get(session)
        if found is not None and found.client.addresses != list(addresses):
            found.client.retarget(list(addresses))

    def _ps_addresses(self, resolver: Any, num_ps: int) -> list[str]:
        """Worker 0: the PS tasks ``0..num_ps-1`` as its resolver lists them now.

        Raises:
            InvalidArgumentError: the cluster lists fewer (both counts named).
        """
        refresh = getattr(resolver, "refresh", None)
        spec = refresh() if callable(refresh) else resolver.cluster_spec()
        listed = sorted(spec.task_indices("ps")) if "ps" in spec.jobs else []
        if len(listed) < num_ps or listed[:num_ps] != list(range(num_ps)):
            raise errors.InvalidArgumentError(
                f"resizing to num_ps={num_ps} parameter servers, but the cluster spec "
                f"lists {len(listed)} ps tasks ({listed}); it must list tasks 0..{num_ps - 1}"
            )
        return [spec.task_address("ps", i) for i in range(num_ps)]

    def resize(self, ring: Any, resolver: Any, num_ps: int, timeout: float) -> Any:
        """Every worker, at one step boundary: the rows move onto ``num_ps`` PS tasks.

        See the module docstring.  Returns the resize's
        :class:`~psflow.distribute.ps.placement.ResizeReport` (worker 0's, on every
        worker).

        Raises:
            InvalidArgumentError: ``num_ps`` < 1 or not an integer, ``timeout`` not
                finite and > 0, or more PS tasks than worker 0's cluster lists:
                nothing changed.
            UnavailableError, DeadlineExceededError: a PS task did not answer (on
                every worker; before any row switched every worker stays on the old tasks).
        """
        from psflow.distribute.ps import resize as resize_lib
        from psflow.distribute.ps.placement import ResizeReport

        if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1:
            raise errors.InvalidArgumentError(f"num_ps must be an integer >= 1, got {num_ps!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise errors.InvalidArgumentError(f"resize timeout {timeout!r} must be a number")
        if not 0 < timeout < float("inf"):
            raise errors.InvalidArgumentError(f"resize timeout {timeout!r} must be finite and > 0")
        # worker 0's view of the cluster decides, for every worker
        plan: dict[str, Any] = {}
        if ring.rank == 0:
            try:
                plan = {"addresses": self._ps_addresses(resolver, num_ps)}
            except errors.OpError as e:
                plan = _error_payload(e)
        plan = _share(ring, plan)
        if "error" in plan:
            raise errors.error_class(plan["error"])(plan["message"])
        self.settle(ring)
        outcome = self._resize_on_worker_0(ring, plan["addresses"], timeout, resize_lib)
        if outcome.get("moved"):
            self._repoint(outcome["addresses"], outcome["version"])
        if "error" in outcome:
            raise errors.error_class(outcome["error"])(outcome["message"])
        return ResizeReport(**outcome["report"])

    def _resize_on_worker_0(
        self, ring: Any, addresses: list[str], timeout: float, resize_lib: Any
    ) -> dict:
        """Worker 0 resizes in a thread; every worker polls for the outcome over the ring."""
        session = self.session
        box: dict[str, Any] = {}
        thread = None
        if ring.rank == 0:
            old = session.placement
            old_addresses = [c.address for c in session.connections]

            def moved(deadline: float) -> None:
                # every row is on the new tasks: whatever happens next, the group follows
                box["moved"] = True

            def work() -> None:
                try:
                    report = resize_lib.resize(
                        session, addresses, timeout=timeout, before_drain=moved
                    )
                    box["outcome"] = {"report": dataclasses.asdict(report)}
                except BaseException as e:  # every worker gets it, typed
                    box["outcome"] = _error_payload(e)
                    if not box.get("moved"):
                        # no row switched (or the switch itself broke): back to the old tasks
                        session.resize_origin = None
                        try:
                            session.adopt_tasks(old_addresses, version=old.version)
                        except errors.OpError as again:
                            log.warning(
                                "hybrid resize: cannot go back to %s: %s", old_addresses, again
                            )
                if box.get("moved"):
                    placement = session.placement
                    box["outcome"].update(
                        moved=True,
                        addresses=list(placement.addresses),
                        version=placement.version,
                    )

            thread = threading.Thread(target=work, name="hybrid-resize", daemon=True)
            thread.start()
        deadline = time.monotonic() + timeout + _RESIZE_GRACE_SECONDS
        while True:  # bounded: worker 0's resize has a deadline, and so has this loop
            outcome = None
            if thread is not None:
                thread.join(_RESIZE_POLL_SECONDS)
                if not thread.is_alive():
                    outcome = box["outcome"]
                elif time.monotonic() > deadline:
                    outcome = {
                        "error": int(errors.Code.DEADLINE_EXCEEDED),
                        "message": f"resizing to {len(addresses)} parameter servers did not "
                        f"end within {timeout}s",
                    }
            try:
                outcome = _share(ring, outcome)
            except errors.OpError:
                if thread is not None:  # a peer is gone: nothing may move on under training
                    thread.join(max(deadline - time.monotonic(), 0.0))
                    if box.get("moved") and "outcome" in box:
                        self._repoint(box["outcome"]["addresses"], box["outcome"]["version"])
                raise
            if outcome is not None:
                return outcome
            if time.monotonic() > deadline + _RESIZE_GRACE_SECONDS:
                raise errors.DeadlineExceededError(
                    f"worker 0 did not report its resize to {len(addresses)} parameter "
                    f"servers within {timeout}s"
                )
