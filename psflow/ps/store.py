"""The variable store of one parameter-server task: plain Python, no gRPC.

It creates variables, serves reads (whole or rows), applies pushed gradients
through each variable's update rule with the slots held here, assigns, and
counts.  Guarantees:

* **Thread safety.** Each variable has its own lock; a push that touches several
  variables takes their locks in name order, so concurrent pushes never lose an
  update and never deadlock.  Bytes travel outside the locks (copy on write).
* **No partial state change on bad input.** Every part of a request (names,
  dtypes, shapes, indices, sync parameters, staleness bounds) is validated
  before anything is changed; a rejected request changes nothing but the
  rejection counters.
* **Exactly once.** A push (and an assign_add/sub) carries ``(client_id,
  sequence)``; a retry of an id already processed gets the original reply.
* **Moves.** A variable exported to another task (a resize of the parameter
  servers) is gone from here: any later request naming it gets ``MovedError``
  with the new owner, and nothing of that request is applied.  The ids of the
  pushes that touched it move with it (see :class:`~psflow.ps.dedup.TouchLog`).
* **Synchronous steps.** A push naming ``step`` and ``num_required`` is held
  until that many contributions for the step arrived; their mean (summed in
  ``(client_id, sequence)`` order, so the result does not depend on arrival
  order) is applied once, the version bumps once, and later contributions for
  that step (or an older one) are rejected with ``AbortedError``.

Example:
    >>> import numpy as np
    >>> store = VariableStore()
    >>> _ = store.create([VariableMeta("w", np.dtype("float32"), (2,))], [np.ones(2, "float32")])
    >>> _ = store.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 0.5})
    >>> _ = store.push([Gradient("w", np.ones(2, "float32"))], push_id=("c", 1))
    >>> store.pull(["w"])[0].value
    array([0.5, 0.5], dtype=float32)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import operator
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from psflow.errors import (
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    MovedError,
    NotFoundError,
    OpError,
    ResourceExhaustedError,
    UnavailableError,
)
from psflow.security.limits import limit_exceeded
from psflow.update_rules import UpdateRule, dedupe_rows, rule_from_config
from psflow.wire.codec import default_max_tensor_bytes, dtype_to_wire

from . import write_ops
from .dedup import DedupWindow, State, TouchLog
from .migration import PushRecord, decode_shard, encode_shard
from .names import check_name, quote
from .push_types import Gradient, PushContext, PushReply
from .rule_cache import RuleCache
from .stats import PushLogEntry, Stats
from .tensors import Segments, as_segments, check_extent
from .variables import PendingStep, Variable, VariableMeta

__all__ = [
    "Gradient",
    "PulledTensor",
    "PushReply",
    "VariableInfo",
    "VariableMeta",
    "VariableStore",
]

log = logging.getLogger(__name__)

MAX_PENDING_STEPS = 16
# The longest a call waits inside the store (a retry racing its original, a sync
# step's completion): a caller without a deadline must not hold a thread forever.
MAX_WAIT_SECONDS = 600.0
# Client ids remembered as well-formed (checking one per push costs as much as a lookup).
MAX_CHECKED_CLIENTS = 4096
# Seconds between two checks that the client of a waiting sync push is still there.
_GONE_CHECK = 0.5


def _bounded_wait(timeout: float | None) -> float:
    """``timeout`` clamped to ``[0, MAX_WAIT_SECONDS]`` (None: the maximum)."""
    if timeout is None or not timeout < MAX_WAIT_SECONDS:  # also catches NaN
        return MAX_WAIT_SECONDS
    return max(0.0, float(timeout))


@dataclasses.dataclass(frozen=True)
class MovedTo:
    """Where a variable this task gave away lives now."""

    owner: int
    address: str
    version: int


@dataclasses.dataclass(frozen=True)
class PulledTensor:
    """A value read from the store, with the version it belongs to."""

    name: str
    value: np.ndarray
    version: int


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """What :meth:`VariableStore.list_variables` reports per variable."""

    meta: VariableMeta
    optimizer_json: str
    slot_names: tuple[str, ...]
    version: int
    optimizer_step: int
    sync_step: int
    shm_name: str = ""


class VariableStore:
    """Variables of one PS task; see the module docstring for the guarantees.

    Args:
        task: this task's name, used in messages (``"ps:0"``).
        max_tensor_bytes: largest variable or payload tensor accepted.
        max_variables: most variables held (None: no limit); a create beyond it
            is rejected with ``ResourceExhaustedError``.
        dedup_window: request ids remembered per client.
        log_size: entries kept in the push log.
        max_sync_contributors: the largest ``num_required`` a sync step may
            name (None: no limit); it bounds the contributions one step keeps.
    """

    def __init__(
        self,
        *,
        task: str = "ps:0",
        max_tensor_bytes: int | None = None,
        max_variables: int | None = None,
        dedup_window: int = 4096,
        log_size: int = 10_000,
        mirrors: Any = None,
        max_sync_contributors: int | None = None,
    ) -> None:
        self.max_sync_contributors = max_sync_contributors
        self.task = task
        # psflow.transport.shm.MirrorSet: dense values published for same-host readers
        self.mirrors = mirrors
        self.step = 0  # training step of the last checkpoint saved or restored
        self.max_tensor_bytes = max_tensor_bytes or default_max_tensor_bytes()
        self.max_variables = max_variables
        self._vars: dict[str, Variable] = {}
        self._lock = threading.Lock()  # guards the dict, not the variables
        self._dedup = DedupWindow(window=dedup_window)
        self._touched = TouchLog()
        self._moved: dict[str, MovedTo] = {}  # variables handed over to another task
        # variables exported and not yet released: writes wait (UNAVAILABLE, retried)
        self._fenced: set[str] = set()
        self.placement_version = 0  # of the newest placement map this task took part in
        self.drained = threading.Event()  # set once told to exit after giving everything away
        self.stats = Stats(log_size=log_size)
        self._pushed_rules = RuleCache()  # a push's rule JSON, parsed once per distinct text
        self._rejections = _Rejecting(self.stats)
        self._checked_clients: set[str] = set()  # client ids that passed check_name

    # -- helpers -----------------------------------------------------------
    def _rejecting(self) -> _Rejecting:
        """Counts typed errors raised inside as rejections, by code or reason."""
        return self._rejections

    def _get(self, name: str) -> Variable:
        var = self._vars.get(name)
        if var is None:
            moved = self._moved.get(name)
            if moved is not None:
                raise MovedError(
                    f"variable {quote(name)} moved from {self.task} to ps:{moved.owner} at "
                    f"{moved.address} (placement version {moved.version})",
                    key=name,
                    owner=moved.owner,
                    address=moved.address,
                    version=moved.version,
                )
            raise NotFoundError(f"variable {quote(name)} not found on {self.task}")
        return var

    def _lookup(self, names: Sequence[str]) -> list[Variable]:
        if len(names) == 1:  # the common push: no set, no lock (a dict read is atomic)
            return [self._get(names[0])]
        with self._lock:
            seen = set()
            for n in names:
                if n in seen:
                    raise InvalidArgumentError(f"variable {quote(n)} named twice in one request")
                seen.add(n)
            return [self._get(n) for n in names]

    @staticmethod
    def _locked(variables: Sequence[Variable]) -> Any:
        """A context manager holding the variables' locks, taken in name order."""
        if len(variables) == 1:
            return variables[0].lock
        return _LockedInOrder(variables)

    def _check_values(self, var: Variable, values: Any, what: str) -> Segments:
        seg = as_segments(values)
        if seg.dtype != var.meta.dtype:
            raise InvalidArgumentError(
                f"{what} for {var.meta.name!r} has dtype {seg.dtype.name}, "
                f"the variable is {var.meta.dtype.name}"
            )
        if seg.shape != var.meta.shape:
            raise InvalidArgumentError(
                f"{what} for {var.meta.name!r} has shape {seg.shape}, "
                f"the variable is {var.meta.shape}"
            )
        return seg

    def _check_meta(self, meta: VariableMeta) -> None:
        check_name(meta.name)
        dtype_to_wire(meta.dtype)
        if any(d < 0 for d in meta.shape):
            raise InvalidArgumentError(f"variable {meta.name!r} has negative shape {meta.shape}")
        check_extent(
            meta.shape, meta.dtype.itemsize, self.max_tensor_bytes, what=f"variable {meta.name!r}"
        )
        if meta.nbytes > self.max_tensor_bytes:
            err = ResourceExhaustedError(
                f"variable {meta.name!r} of shape {meta.shape} is {meta.nbytes} bytes, above "
                f"the limit of {self.max_tensor_bytes} (max_tensor_bytes)"
            )
            err.reason = "tensor_too_large"
            raise err

    # -- create / configure --------------------------------------------------
    def create(
        self,
        metas: Sequence[VariableMeta],
        values: Sequence[Any],
        optimizers: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[tuple[bool, int]]:
        """Creates variables; returns ``(created, version)`` per variable.

        A variable that exists with the same dtype, shape and trainability (and
        the same optimizer, when one is given) is left unchanged (idempotent).

        Raises:
            AlreadyExistsError: a variable exists with a conflicting spec.
            InvalidArgumentError: bad name, dtype, shape, value or optimizer.
            ResourceExhaustedError: a variable above ``max_tensor_bytes``, or
                more than ``max_variables`` in all.
        """
        optimizers = list(optimizers) if optimizers is not None else [None] * len(metas)
        with self._rejecting():
            if not (len(metas) == len(values) == len(optimizers)):
                raise InvalidArgumentError("create needs one value and optimizer per variable")
            names = [m.name for m in metas]
            if len(set(names)) != len(names):
                raise InvalidArgumentError(f"variable names repeated in one create: {names}")
            rules = []
            for meta, value, opt in zip(metas, values, optimizers, strict=True):
                self._check_meta(meta)
                seg = as_segments(value)
                if seg.dtype != meta.dtype or seg.shape != meta.shape:
                    raise InvalidArgumentError(
                        f"initial value of {meta.name!r} is {seg.dtype.name}{list(seg.shape)}, "
                        f"the spec says {meta.dtype.name}{list(meta.shape)}"
                    )
                rule = rule_from_config(opt) if opt is not None else None
                if rule is not None and (not meta.trainable or meta.dtype.kind != "f"):
                    raise InvalidArgumentError(
                        f"variable {meta.name!r} ({meta.dtype.name}, trainable={meta.trainable}) "
                        "cannot have an optimizer"
                    )
                rules.append(rule)
            results: list[tuple[bool, int]] = []
            with self._lock:
                new = sum(m.name not in self._vars for m in metas)
                if self.max_variables is not None and len(self._vars) + new > self.max_variables:
                    err = ResourceExhaustedError(
                        f"creating {new} variables on {self.task}, which holds "
                        f"{len(self._vars)}, would exceed the limit of {self.max_variables} "
                        "(max_variables)"
                    )
                    err.reason = "too_many_variables"
                    raise err
                for meta, rule in zip(metas, rules, strict=True):
                    existing = self._vars.get(meta.name)
                    if existing is None:
                        continue
                    same_rule = rule is None or existing.optimizer_json == json.dumps(
                        rule.get_config(), sort_keys=True
                    )
                    if existing.meta != meta or not same_rule:
                        raise AlreadyExistsError(
                            f"variable {meta.name!r} exists on {self.task} as "
                            f"{existing.meta.dtype.name}{list(existing.meta.shape)} "
                            f"trainable={existing.meta.trainable} "
                            f"optimizer={existing.optimizer_json or None}; requested "
                            f"{meta.dtype.name}{list(meta.shape)} trainable={meta.trainable} "
                            f"optimizer={rule.get_config() if rule else None}"
                        )
                for meta, value, rule in zip(metas, values, rules, strict=True):
                    existing = self._vars.get(meta.name)
                    if existing is not None:
                        results.append((False, existing.version))
                        continue
                    seg = as_segments(value)
                    # Own the buffer: copy a caller's array, adopt a fresh join.
                    array = seg.to_array()
                    if len(seg.parts) == 1:
                        array = array.copy()
                    var = Variable(meta, array)
                    if rule is not None:
                        var.set_rule(rule)
                    self._vars[meta.name] = var
                    if self.mirrors is not None:
                        self.mirrors.attach(var)
                    self.stats.add(bytes_in=meta.nbytes)
                    results.append((True, var.version))
        log.debug("created %s", [n for n, (c, _) in zip(names, results, strict=True) if c])
        return results

    def configure_optimizer(self, names: Sequence[str], config: dict[str, Any]) -> tuple[str, ...]:
        """Attaches the update rule ``config`` to trainable float variables.

        Slots and the optimizer step are kept when the rule keeps its slot
        layout (e.g. a new learning rate) and reset otherwise.

        Returns:
            The slot names.

        Raises:
            NotFoundError, InvalidArgumentError: unknown variable, bad config,
                non-trainable or non-float variable (nothing is changed).
        """
        with self._rejecting():
            rule = rule_from_config(config)
            variables = self._lookup(names)
            for var in variables:
                if not var.meta.trainable or var.meta.dtype.kind != "f":
                    raise InvalidArgumentError(
                        f"variable {var.meta.name!r} ({var.meta.dtype.name}, "
                        f"trainable={var.meta.trainable}) cannot have an optimizer"
                    )
            with self._locked(variables):
                for var in variables:
                    var.set_rule(rule)
        return rule.slot_names

    # -- reads -----------------------------------------------------------------
    def reading(self, names: Sequence[str], rows: dict[int, np.ndarray] | None = None) -> _Reading:
        """Consistent snapshots of variables, valid inside the ``with`` block.

        ``rows`` maps an item's position to the row indices to read instead of
        the whole value.  Whole values are views of the live buffer (do not
        modify them); writers copy on write while the block runs.

        Raises:
            NotFoundError, InvalidArgumentError: unknown variable, bad indices
                (on entering the block).
        """
        return _Reading(self, names, rows or {})

    def _check_rows(self, variables: list[Variable], rows: dict[int, Any]) -> dict[int, Any]:
        checked = {}
        for i, idx in rows.items():
            meta = variables[i].meta
            idx = np.asarray(idx)
            if idx.ndim != 1 or idx.dtype.kind not in "iu":
                raise InvalidArgumentError(
                    f"row indices for {meta.name!r} must be a 1-D integer array, got "
                    f"{idx.dtype.name}{list(idx.shape)}"
                )
            if not meta.shape:
                raise InvalidArgumentError(f"cannot read rows of scalar {meta.name!r}")
            if idx.size and (idx.min() < 0 or idx.max() >= meta.shape[0]):
                bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
                raise InvalidArgumentError(
                    f"row index {bad} out of range for {meta.name!r} of shape {meta.shape}"
                )
            checked[i] = idx
        return checked

    def pull(
        self, names: Sequence[str], rows: dict[int, np.ndarray] | None = None
    ) -> list[PulledTensor]:
        """Copies of variables (or of their rows); see :meth:`reading`."""
        with self.reading(names, rows) as tensors:
            return [PulledTensor(t.name, np.array(t.value), t.version) for t in tensors]

    # -- assign ------------------------------------------------------------------
    def assign(
        self,
        op: str,
        names: Sequence[str],
        values: Sequence[Any],
        *,
        request_id: tuple[str, int] | None = None,
    ) -> list[int]:
        """``assign``/``assign_add``/``assign_sub`` whole values; returns new versions.

        ``request_id`` makes a retried assign_add/sub apply once.

        Raises:
            NotFoundError, InvalidArgumentError: unknown variable, dtype or shape
                mismatch, unknown op (nothing is changed).
        """
        with self._rejecting():
            write_ops.check(op)
            if len(names) != len(values):
                raise InvalidArgumentError(f"{len(names)} names but {len(values)} values")
            variables = self._lookup(names)
            segs = [self._check_values(v, x, op) for v, x in zip(variables, values, strict=True)]
            for var in variables:
                if op != "assign" and var.meta.dtype == np.bool_:
                    raise InvalidArgumentError(f"{op} is not defined for bool {var.meta.name!r}")

        def run() -> list[int]:
            with self._locked(variables):
                with self._rejecting():
                    self._check_held(variables)
                for var, seg in zip(variables, segs, strict=True):
                    var.assign(op, seg)
                self.stats.add(bytes_in=sum(s.nbytes for s in segs))
                return [v.version for v in variables]

        if request_id is None:
            return run()
        return self._once(request_id, run, lambda versions: versions)

    def _once(self, request_id: tuple[str, int], run, on_duplicate, wait=None):
        """Runs ``run`` once per request id; duplicates get ``on_duplicate(reply)``."""
        client_id, sequence = request_id
        with self._rejecting():
            if client_id not in self._checked_clients:
                check_name(client_id, "client id")
                if len(self._checked_clients) >= MAX_CHECKED_CLIENTS:
                    self._checked_clients.clear()  # bounded: many clients, check again
                self._checked_clients.add(client_id)
            if int(sequence) < 0:
                raise InvalidArgumentError(f"bad request id sequence {sequence!r}")
        for _ in range(100):
            state, entry = self._dedup.begin(client_id, int(sequence))
            if state is State.NEW:
                try:
                    reply = run()
                except BaseException:
                    self._dedup.abandon(client_id, sequence, entry)
                    raise
                self._dedup.complete(client_id, sequence, entry, reply)
                return reply
            if state is State.TOO_OLD:
                with self._rejecting():
                    raise AbortedError(
                        f"request id {request_id} is older than the {self.task} "
                        "deduplication window; it may or may not have been applied"
                    )
            entry.done.wait(_bounded_wait(wait))
            if not entry.done.is_set():
                raise DeadlineExceededError(f"request id {request_id} still in progress")
            if entry.reply is not None:
                self.stats.add(pushes_duplicate=1)
                return on_duplicate(entry.reply)
            # The original failed without changing anything: process this one afresh.
        raise AbortedError(f"request id {request_id} kept failing concurrently")  # pragma: no cover

    def _check_held(self, variables: Sequence[Variable]) -> None:
        """Raises if a variable left, or is being handed over, while the request waited.

        Called with the variables' locks held, right before a change.

        Raises:
            MovedError: it moved to another task.
            UnavailableError: it is being handed over (exported, not yet
                released): retry shortly, the answer will be MovedError.
        """
        with self._lock:
            for var in variables:
                if self._vars.get(var.meta.name) is not var:
                    self._get(var.meta.name)  # raises MovedError (or NotFoundError)
                if var.meta.name in self._fenced:
                    err = UnavailableError(
                        f"variable {quote(var.meta.name)} is being handed over to another "
                        f"parameter server by {self.task}; retry"
                    )
                    err.reason = "handover"
                    raise err

    # -- push ----------------------------------------------------------------------
    def _validate_push(
        self,
        grads: Sequence[Gradient],
        step: int | None,
        num_required: int,
        rule: UpdateRule | None = None,
    ) -> list[tuple[Variable, Gradient, Any, Any]]:
        """Checks everything that does not depend on the variables' current state."""
        if not grads:
            raise InvalidArgumentError("push without gradients")
        if step is not None:
            if int(step) < 0:
                raise InvalidArgumentError(f"sync step must be >= 0, got {step}")
            if int(num_required) < 1:
                raise InvalidArgumentError(
                    f"sync step {step} needs num_required >= 1, got {num_required}"
                )
            limit = self.max_sync_contributors
            if limit is not None and int(num_required) > limit:
                raise limit_exceeded(
                    "too_many_contributors",
                    f"sync step {step} with num_required={num_required}",
                    int(num_required),
                    limit,
                    "--max-sync-contributors",
                )
        variables = self._lookup([g.name for g in grads])
        checked = []
        for var, g in zip(variables, grads, strict=True):
            meta = var.meta
            if not meta.trainable:
                raise FailedPreconditionError(f"variable {meta.name!r} is not trainable")
            if rule is not None:
                _check_pushed_rule(var, rule)
            elif var.rule is None:
                raise FailedPreconditionError(
                    f"variable {meta.name!r} has no optimizer; push with a rule or call "
                    "configure_optimizer first"
                )
            if g.sparse:
                values = np.asarray(
                    g.values.to_array() if isinstance(g.values, Segments) else g.values
                )
                if values.dtype != meta.dtype:
                    raise InvalidArgumentError(
                        f"gradient rows for {meta.name!r} have dtype {values.dtype.name}, "
                        f"the variable is {meta.dtype.name}"
                    )
                if not meta.shape or values.shape[1:] != meta.shape[1:]:
                    raise InvalidArgumentError(
                        f"gradient rows for {meta.name!r} have shape {values.shape}, the "
                        f"variable is {meta.shape}"
                    )
                indices, values = dedupe_rows(g.indices, values, meta.shape[0])
                checked.append((var, g, indices, values))
            else:
                checked.append((var, g, self._check_values(var, g.values, "gradient"), None))
        return checked

    def push(
        self,
        grads: Sequence[Gradient],
        context: PushContext | None = None,
        client_gone: Callable[[], bool] | None = None,
        **fields: Any,
    ) -> PushReply:
        """Applies (or, for a sync step, contributes) gradients, exactly once per id.

        Args:
            grads: one per variable; all validated before any is applied.
            context: the request's context, as the session built it (or its
                fields as keywords: ``push_id=(client_id, sequence)``, ...):
                ``push_id`` the exactly-once id; ``step``, ``num_required``
                synchronous aggregation (see module doc); ``wait_applied``
                return only once the sync step is applied; ``max_staleness``
                reject gradients staler than this; ``timeout`` seconds to wait
                with ``wait_applied``; ``rule_json`` the update rule's config
                as JSON (the pusher's rate at its step): installed for these
                variables before they are updated, slots created on first
                use; ``""``: each variable's current rule.  A rule with
                another slot layout than a variable's is rejected.
            client_gone: asked now and then while ``wait_applied`` waits: True
                ends the wait (the contribution still counts).

        Raises:
            NotFoundError, InvalidArgumentError, FailedPreconditionError: bad input.
            AbortedError: the sync step was already applied, the staleness bound
                is exceeded, or the id is older than the dedup window.
            DeadlineExceededError: ``wait_applied`` timed out (the contribution
                still counts).
            CancelledError: the client left while ``wait_applied`` waited (the
                contribution still counts).
        """
        if context is None:
            context = PushContext(**fields)
        push_id, step, num_required = context.push_id, context.step, context.num_required
        rule_json, timeout = context.rule_json, context.timeout
        with self._rejecting():
            rule = self._pushed_rules.get(rule_json) if rule_json else None
            checked = self._validate_push(grads, step, num_required, rule)
        client_id = push_id[0]
        asked = checked
        done = self._touched.adopted(push_id)
        if done:
            # the push reached the variables' former owner before they moved here
            if all(c[0].meta.name in done for c in checked):
                self.stats.add(pushes_duplicate=1)
                versions = tuple(c[0].version for c in checked)
                return PushReply(versions, True, True)
            asked, checked = checked, [c for c in checked if c[0].meta.name not in done]

        def run() -> PushReply:
            variables = [c[0] for c in checked]
            with self._rejecting(), self._locked(variables):
                self._check_held(variables)
                if step is None:
                    reply = self._apply_async(checked, client_id, context.max_staleness, rule)
                else:
                    reply = self._contribute(checked, push_id, int(step), int(num_required), rule)
                self._touched.record(push_id, [c[0].meta.name for c in checked])
                return reply

        result = self._once(push_id, run, lambda r: dataclasses.replace(r, duplicate=True), timeout)
        if context.wait_applied and step is not None and not result.applied:
            self._wait_step([c[0] for c in checked], int(step), timeout, client_gone)
            result = dataclasses.replace(
                result, applied=True, versions=tuple(c[0].version for c in checked)
            )
        if asked is not checked:  # one version per gradient asked for, moved ones included
            result = dataclasses.replace(result, versions=tuple(c[0].version for c in asked))
        return result

    def _apply_async(self, checked, client_id, max_staleness, rule=None) -> PushReply:
        staleness = []
        for var, g, _, _ in checked:
            s = var.version - g.base_version if g.base_version >= 0 else -1
            if g.base_version > var.version:
                # a base version this variable never had (a client's bug, a forged
                # header, or one from before a rollback): its staleness is unknown
                if max_staleness is not None:
                    err = AbortedError(
                        f"gradient for {var.meta.name!r} claims base version "
                        f"{g.base_version}, but the variable is at version {var.version}: "
                        f"its staleness cannot be checked against the bound {max_staleness}"
                    )
                    err.reason = "future_base_version"
                    raise err
                s = -1
            if max_staleness is not None and s > max_staleness:
                err = AbortedError(
                    f"gradient for {var.meta.name!r} is {s} versions stale (base version "
                    f"{g.base_version}, now {var.version}), above the bound {max_staleness}"
                )
                err.reason = "staleness_bound"
                raise err
            staleness.append(s)
        _install_rule(checked, rule)
        entries = []
        for var, g, a, b in checked:
            if g.sparse:
                var.apply_sparse(a, b)
            else:
                var.apply_dense(a)
            entries.append(PushLogEntry(var.meta.name, client_id, g.base_version, var.version))
        self.stats.record_push(entries, staleness, sum(_grad_bytes(c) for c in checked))
        return PushReply(tuple(c[0].version for c in checked), True, False, tuple(staleness))

    def _contribute(self, checked, push_id, step, num_required, rule=None) -> PushReply:
        for var, _, _, _ in checked:
            if step <= var.sync_step:
                err = AbortedError(
                    f"step {step} of {var.meta.name!r} was already applied (last applied "
                    f"sync step {var.sync_step}); contribution rejected"
                )
                err.reason = "stale_step"
                raise err
            pending = var.pending.get(step)
            if pending is not None and pending.num_required != num_required:
                raise InvalidArgumentError(
                    f"step {step} of {var.meta.name!r} needs {pending.num_required} "
                    f"contributions, this push says {num_required}"
                )
            if pending is None and len(var.pending) >= MAX_PENDING_STEPS:
                raise ResourceExhaustedError(
                    f"{var.meta.name!r} already has {len(var.pending)} incomplete sync steps"
                )
        _install_rule(checked, rule)
        applied_all = True
        for var, g, a, b in checked:
            pending = var.pending.setdefault(step, PendingStep(num_required))
            if len(pending.contributions) + 1 < num_required:
                # kept past this request, whose buffers may be lent (a data-plane connection
                # reuses its receive buffer once the handler returns): keep a copy
                a, b = _owned(a), _owned(b)
            pending.contributions[tuple(push_id)] = (None, a, b) if g.sparse else (a, None, None)
            if len(pending.contributions) >= num_required:
                self._apply_step(var, step, pending)
            else:
                applied_all = False
        self.stats.add(bytes_in=sum(_grad_bytes(c) for c in checked))
        self.stats.record_push([], [])
        return PushReply(tuple(c[0].version for c in checked), applied_all)

    def _apply_step(self, var: Variable, step: int, pending: PendingStep) -> None:
        """Applies the mean of a complete step (lock held) and drops older steps."""
        keys = sorted(pending.contributions)
        n = len(keys)
        contributions = [pending.contributions[k] for k in keys]
        if all(c[0] is None for c in contributions):
            indices = np.concatenate([c[1] for c in contributions])
            values = np.concatenate([c[2] for c in contributions])
            indices, values = dedupe_rows(indices, values, var.meta.shape[0])
            values = values / np.asarray(n, dtype=values.dtype)
            var.apply_sparse(indices, values)
        else:
            total = np.zeros(var.meta.shape, var.meta.dtype)
            flat = total.reshape(-1)
            for dense, indices, values in contributions:
                if dense is not None:
                    for offset, part in dense:
                        flat[offset : offset + part.size] += part
                else:
                    np.add.at(total, indices, values)
            np.divide(total, np.asarray(n, dtype=total.dtype), out=total)
            var.apply_dense(total)
        var.sync_step = step
        for s in [s for s in var.pending if s <= step]:
            del var.pending[s]
        self.stats.add(sync_steps_applied=1)
        var.changed.notify_all()

    def _wait_step(
        self,
        variables: Sequence[Variable],
        step: int,
        timeout: float | None,
        client_gone: Callable[[], bool] | None = None,
    ) -> None:
        deadline = time.monotonic() + _bounded_wait(timeout)
        for var in variables:
            with var.lock:
                while var.sync_step < step and step in var.pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceededError(
                            f"sync step {step} of {var.meta.name!r} not applied in time: "
                            f"{len(var.pending[step].contributions)} of "
                            f"{var.pending[step].num_required} contributions arrived"
                        )
                    if client_gone is not None and client_gone():
                        raise CancelledError(
                            f"the client waiting for sync step {step} of {var.meta.name!r} "
                            "left; its contribution counts"
                        )
                    var.changed.wait(left if client_gone is None else min(left, _GONE_CHECK))
                if var.sync_step < step:
                    raise AbortedError(
                        f"sync step {step} of {var.meta.name!r} was dropped: a later step "
                        f"({var.sync_step}) completed first"
                    )

    # -- listing, stats ------------------------------------------------------------
    def list_variables(self) -> list[VariableInfo]:
        """Every variable, sorted by name."""
        with self._lock:
            variables = sorted(self._vars.values(), key=lambda v: v.meta.name)
        out = []
        for var in variables:
            with var.lock:
                out.append(
                    VariableInfo(
                        var.meta,
                        var.optimizer_json,
                        tuple(var.slots),
                        var.version,
                        var.optimizer_step,
                        var.sync_step,
                        var.mirror.name if var.mirror is not None else "",
                    )
                )
        return out

    def stats_snapshot(self, include_log: bool = False) -> dict[str, Any]:
        """Counters plus the number and bytes of variables held."""
        out = self.stats.snapshot(include_log)
        with self._lock:
            out["num_variables"] = len(self._vars)
            out["variable_bytes"] = sum(v.meta.nbytes for v in self._vars.values())
        return out

    # -- checkpoint support ------------------------------------------------------------
    @contextlib.contextmanager
    def exporting(self) -> Iterator[list[Variable]]:
        """Every variable, each locked, for a consistent checkpoint of the shard."""
        with self._lock:
            variables = sorted(self._vars.values(), key=lambda v: v.meta.name)
        with self._locked(variables):
            yield variables

    # -- moves between tasks (resizing) ----------------------------------------------
    def export_shard(self, names: Sequence[str]) -> bytes:
        """A copy of variables with slots, versions and push records, and a fence on them.

        From now until :meth:`release` (or :meth:`unfence`) writes to them are
        refused with ``UnavailableError`` (clients retry; after the release the
        retry is redirected), so no update lands here after the copy. Reads
        are still served.

        Raises:
            NotFoundError, MovedError, InvalidArgumentError: a name not held here.
        """
        with self._rejecting():
            variables = self._lookup(names)
        with self._locked(variables):
            with self._lock:
                self._fenced.update(names)
            records = [PushRecord(c, s, n) for c, s, n in self._touched.export(names)]
            return encode_shard(variables, records)

    def unfence(self, names: Sequence[str]) -> None:
        """Serves writes to exported variables again (their move was abandoned)."""
        with self._lock:
            self._fenced.difference_update(names)

    def import_shard(self, blob: bytes, version: int) -> tuple[str, ...]:
        """Installs variables exported by another task (replacing any copy held); returns names.

        Raises:
            DataLossError: a malformed blob (nothing is installed).
        """
        with self._rejecting():
            state = decode_shard(blob, self.max_tensor_bytes)
        for var in state.variables:
            if self.mirrors is not None:
                self.mirrors.attach(var)
        with self._lock:
            old = [self._vars.get(v.meta.name) for v in state.variables]
            for var in state.variables:
                self._vars[var.meta.name] = var
                self._moved.pop(var.meta.name, None)
                self._fenced.discard(var.meta.name)
            self.placement_version = max(self.placement_version, int(version))
        self._touched.adopt((r.client_id, r.sequence, r.names) for r in state.records)
        self._retire([v for v in old if v is not None])
        self.stats.add(bytes_in=sum(v.meta.nbytes for v in state.variables))
        return tuple(v.meta.name for v in state.variables)

    def release(self, names: Sequence[str], owner: int, address: str, version: int) -> None:
        """Gives variables up: from now on requests naming them get ``MovedError``.

        Raises:
            NotFoundError, MovedError: a name not held here (nothing changes).
        """
        with self._rejecting():
            variables = self._lookup(names)
        moved = MovedTo(int(owner), str(address), int(version))
        # the variables' locks first: no push is half-way through a variable that leaves
        with self._locked(variables), self._lock:
            for var in variables:
                del self._vars[var.meta.name]
                self._moved[var.meta.name] = moved
                self._fenced.discard(var.meta.name)
            self.placement_version = max(self.placement_version, int(version))
        self._touched.forget(names)
        self._retire(variables)

    def _retire(self, variables: Sequence[Variable]) -> None:
        """Wakes waiters on variables no longer served here and retires their mirrors."""
        for var in variables:
            with var.lock:
                var.pending.clear()
                var.changed.notify_all()
                if self.mirrors is not None:
                    self.mirrors.detach(var)

    def drain(self) -> None:
        """Marks this task drained (it holds nothing; its process may exit).

        Raises:
            FailedPreconditionError: it still holds variables (named).
        """
        with self._lock:
            held = sorted(self._vars)
        if held:
            with self._rejecting():
                raise FailedPreconditionError(
                    f"{self.task} still holds {len(held)} variables ({[quote(n) for n in held[:5]]}"
                    "...); move them before draining it"
                )
        self.drained.set()

    def replace_all(self, variables: Sequence[Variable]) -> None:
        """Replaces the whole shard (after a restore); forgets request ids."""
        if self.mirrors is not None:
            for var in variables:
                self.mirrors.attach(var)
        with self._lock:
            old = list(self._vars.values())
            self._vars = {v.meta.name: v for v in variables}
            for var in variables:  # restored here: this task holds it again
                self._moved.pop(var.meta.name, None)
            self._fenced.clear()
        self._dedup.clear()
        self._touched.clear()
        for var in old:  # wake anyone waiting on a step that will never come
            with var.lock:
                var.pending.clear()
                var.changed.notify_all()
                if self.mirrors is not None:
                    self.mirrors.detach(var)

    def close(self) -> None:
        """Removes the shared-memory mirrors (the variables stay usable in this process)."""
        if self.mirrors is not None:
            with self._lock:
                variables = list(self._vars.values())
            for var in variables:
                with var.lock:
                    self.mirrors.detach(var)


def _install_rule(checked, rule: UpdateRule | None) -> None:
    """Installs a pushed rule (locks held, every other check passed).

    Checked again first, for all before any is installed: a concurrent first
    push may have installed another rule since the push was validated.
    """
    if rule is None:
        return
    for var, _, _, _ in checked:
        _check_pushed_rule(var, rule)
    for var, _, _, _ in checked:
        if var.rule is not rule:
            var.set_rule(rule)


def _check_pushed_rule(var: Variable, rule: UpdateRule) -> None:
    """Rejects a pushed rule ``var`` cannot take: not trainable float, other slots."""
    meta = var.meta
    if meta.dtype.kind != "f":
        raise InvalidArgumentError(
            f"variable {meta.name!r} ({meta.dtype.name}) cannot have an optimizer"
        )
    held = var.rule
    # the layout test of Variable.set_rule: same rule kind, same slots (a new rate only)
    if (
        held is not None
        and held is not rule
        and (held.name != rule.name or held.slot_names != rule.slot_names)
    ):
        raise InvalidArgumentError(
            f"variable {meta.name!r} has the slots of rule {held.name!r} "
            f"{list(held.slot_names)}; the push's rule {rule.name!r} needs "
            f"{list(rule.slot_names)}"
        )


class _Reading:
    """The context manager :meth:`VariableStore.reading` returns (a class, not a
    generator: every pull enters one)."""

    __slots__ = ("_held", "_names", "_rows", "_store")

    def __init__(self, store: VariableStore, names: Sequence[str], rows: dict[int, Any]) -> None:
        self._store = store
        self._names = names
        self._rows = rows
        self._held: list[tuple[Variable, np.ndarray]] = []

    def __enter__(self) -> list[PulledTensor]:
        store = self._store
        with store._rejecting():
            with store._lock:
                variables = [store._get(n) for n in self._names]
            checked = store._check_rows(variables, self._rows) if self._rows else {}
        out: list[PulledTensor] = []
        try:
            for i, var in enumerate(variables):
                with var.lock:
                    if i in checked:
                        out.append(PulledTensor(var.meta.name, var.value[checked[i]], var.version))
                    else:
                        value, version = var.acquire_read()
                        if var.mirror is not None:  # a reader of a dormant mirror pulls
                            var.mirror.wake(value, version)  # here: it follows again
                        self._held.append((var, value))
                        out.append(PulledTensor(var.meta.name, value, version))
            store.stats.record_pull(sum(t.value.nbytes for t in out))
        except BaseException:
            self._release()
            raise
        return out

    def __exit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        for var, value in self._held:
            with var.lock:
                var.release_read(value)
        self._held.clear()


class _Rejecting:
    """Counts typed errors raised inside as rejections (reusable, stateless)."""

    __slots__ = ("_stats",)

    def __init__(self, stats: Stats) -> None:
        self._stats = stats

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, OpError):
            self._stats.reject(getattr(exc, "reason", None) or exc.code.name.lower())
        return False


class _LockedInOrder:
    """Holds the variables' locks, taken in name order.

    Plain locks taken and released by hand, in a class of its own: an ExitStack,
    or a generator's context manager, costs more per push than the bookkeeping
    of a small variable's update.
    """

    __slots__ = ("_locks",)

    def __init__(self, variables: Sequence[Variable]) -> None:
        self._locks = [v.lock for v in sorted(set(variables), key=_BY_NAME)]

    def __enter__(self) -> None:
        taken = 0
        try:
            for lock in self._locks:
                lock.acquire()
                taken += 1
        except BaseException:
            for lock in reversed(self._locks[:taken]):
                lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self._locks):
            lock.release()


_BY_NAME = operator.attrgetter("meta.name")


def _owned(values: Any) -> Any:
    """A copy of a gradient's values (``Segments`` or an array; None stays None)."""
    if isinstance(values, Segments):
        return Segments(values.dtype, values.shape, [(o, p.copy()) for o, p in values])
    return None if values is None else np.array(values)


def _grad_bytes(c) -> int:
    _var, g, a, b = c
    if g.sparse:
        return a.nbytes + b.nbytes
    return a.nbytes
