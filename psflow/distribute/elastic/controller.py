"""The elastic side of a MultiWorkerMirroredStrategy: re-forming the group and redoing a step.

Every step starts at a boundary (:mod:`.input`): the controller snapshots the
training state (:mod:`.state`), then the group passes a barrier (an
all-reduce of who drains).  Every collective of the step runs through
:meth:`ElasticController.call`, which logs it.  When one fails because the
ring broke:

1. this worker closes its ring (its neighbours notice at once), puts back
   the snapshot, and agrees on the new group with the other survivors
   (:func:`psflow.collective.membership.agree`);
2. it connects the ring of the new generation and receives the state of the
   decision's source member (a broadcast), so every member holds the same
   bits at the resume step;
3. the interrupted step is cut again for the new group (:meth:`recut`) and
   the logged calls of the step are replayed with the new inputs (their
   results replace the old ones wherever the user's code passed them on),
   then the failed call runs again and returns to the user's code as if
   nothing had happened.

A worker that had finished the step the group resumes at (it was waiting at
the next barrier) takes that step again: its loop body sees it twice, its
state does not.  A worker whose drain signal arrived leaves after the next
barrier: the others go on without it, with no step lost and no state moved.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from psflow import errors
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.door import Door
from psflow.collective.membership import Decision, Position, View, agree
from psflow.collective.peer_link import PeerLinks
from psflow.distribute.elastic.options import BatchPolicy, ElasticOptions, MembershipChange
from psflow.distribute.elastic.state import TrainingState
from psflow.util import nest

__all__ = ["ElasticController"]

log = logging.getLogger("psflow.elastic")
_TASK = re.compile(r"worker:(\d+)")
_MAX_REFORMS = 16  # re-forms in a row for one call before giving up (each is bounded)


def _same(value: Any) -> Any:
    return value


def _pairs(old: Any, new: Any) -> dict[int, tuple[Any, Any]]:
    """``old`` and its leaves by identity, each with its counterpart in ``new``.

    Plain numbers and strings are left out: Python shares them, so their
    identity says nothing about where they came from.
    """
    out: dict[int, tuple[Any, Any]] = {}
    if old is None or isinstance(old, (bool, int, float, str, bytes)):
        return out
    out[id(old)] = (old, new)
    flat_old, flat_new = nest.flatten(old), nest.flatten(new)
    if len(flat_old) == len(flat_new):
        for o, n in zip(flat_old, flat_new):
            if o is not None and not isinstance(o, (bool, int, float, str, bytes)):
                out[id(o)] = (o, n)
    return out


class ElasticController:
    """Membership, snapshots and replay for one elastic strategy (see the module docstring).

    Args:
        strategy: the MultiWorkerMirroredStrategy it serves.
        options: the elastic options.
        door: this worker's listening port.
        view: generation 0.
        me: this worker's id.
        timeout: the collectives' silence timeout (seconds).
    """

    def __init__(
        self,
        strategy: Any,
        options: ElasticOptions,
        door: Door,
        view: View,
        me: int,
        timeout: float,
    ) -> None:
        self._strategy = strategy
        self.options = options
        self.door = door
        self.view = view
        self.me = me
        self.timeout = timeout
        self.state = TrainingState()
        self.completed = 0
        self.per_replica_batch = 0
        self.changes: list[MembershipChange] = []
        self._listeners: list[Callable[[MembershipChange], None]] = []
        self._drain_listeners: list[Callable[[list[int]], None]] = []
        self._stepped = False
        self._snapshot: dict[str, Any] | None = None
        self._position = Position(0)
        self._iterator: Any = None
        self._log: list[tuple[Callable[[Callable[[Any], Any]], Any], Any]] = []
        self._skip_barrier = False
        # the step's inputs and earlier results, old -> new, once the step was redone
        self._substitute: Callable[[Any], Any] = _same
        self.draining = False
        self._install_drain_handler()

    # -- what the input needs ---------------------------------------------------------
    @property
    def batch_policy(self) -> BatchPolicy:
        """The options' batch policy."""
        return self.options.batch_policy

    @property
    def unchanged(self) -> bool:
        """Whether the group is still the one that started."""
        return self.view.generation == 0

    @property
    def num_replicas(self) -> int:
        """Replicas of the current group."""
        return self._strategy.num_replicas_in_sync

    @property
    def rank(self) -> int:
        """This worker's index in the current group."""
        return self.view.rank_of(self.me)

    def add_listener(self, listener: Callable[[MembershipChange], None]) -> Callable[[], None]:
        """Calls ``listener(change)`` after each change; returns a function that removes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def add_drain_listener(self, listener: Callable[[list[int]], None]) -> None:
        """Calls ``listener(leaving ids)`` on every member when workers drain, before they leave
        (the group's state is the same everywhere then: a checkpoint can be written)."""
        self._drain_listeners.append(listener)

    # -- draining ----------------------------------------------------------------------
    def _install_drain_handler(self) -> None:
        sig = self.options.drain_signal
        if sig is None or threading.current_thread() is not threading.main_thread():
            return

        def drain(signum: int, frame: Any) -> None:
            self.draining = True

        signal.signal(sig, drain)

    # -- step boundaries ---------------------------------------------------------------
    def boundary(self, iterator: Any, position: Position) -> None:
        """A step boundary: counts the step just done, snapshots the state, starts a new log."""
        if self._stepped:
            self.completed += 1
            self._stepped = False
            position = Position(self.completed, position.epoch, position.offset)
        self._iterator = iterator
        self._position = position
        self._snapshot = self.state.snapshot()
        self._log = []
        self._substitute = _same

    def stepped(self) -> None:
        """The iterator gave the user a step."""
        self._stepped = True

    def barrier(self, iterator: Any) -> bool:
        """The group's barrier; False when this epoch has no step left for this worker.

        Raises:
            SystemExit: this worker drained (exit status 0).
        """
        if self._skip_barrier:  # the group re-formed at an epoch's end: it passed this one
            self._skip_barrier = False
            return True
        flags = np.zeros(len(self.view.members), np.int64)
        if self.draining:
            flags[self.rank] = 1
        try:
            (flags,) = self._strategy._ring.all_reduce([flags])
        except BaseException as e:
            if not self._broken():
                raise
            decision = self._recover_until_formed(e)
            going_on = iterator.resume_at(decision.resume)
            self._skip_barrier = not going_on  # the next epoch's first barrier is passed too
            return going_on
        leaving = [m for m, f in zip(self.view.members, flags) if f > 0]
        if leaving:
            self._drain(leaving)
        return True

    # -- collectives ---------------------------------------------------------------------
    def _broken(self) -> bool:
        links = self._strategy._ring.links
        return links is not None and links.failure is not None

    def call(self, thunk: Callable[[Callable[[Any], Any]], Any]) -> Any:
        """Runs one collective-bearing call of the step, ``thunk(substitute)``; redone on a change.

        ``substitute`` maps the call's arguments from the interrupted step to the
        replayed one's (the identity until the step is redone).
        """
        for _ in range(_MAX_REFORMS):
            try:
                result = thunk(self._substitute)
            except BaseException as e:
                if not self._broken():
                    raise
                self._substitute = self._recover_and_replay(e)
                continue
            self._log.append((thunk, result))
            return result
        raise errors.AbortedError(f"elastic: {_MAX_REFORMS} re-forms in a row for one call")

    def _recover_and_replay(self, error: BaseException) -> Callable[[Any], Any]:
        for _ in range(_MAX_REFORMS):
            decision = self._recover_until_formed(error)
            pairs: list[tuple[Any, Any]] = []
            if self._iterator is not None:
                pairs = self._iterator.recut(decision.resume)
                self._stepped = True
            mapping = {}
            for old, new in pairs:
                mapping.update(_pairs(old, new))

            def substitute(value: Any, _m: dict[int, tuple[Any, Any]] = mapping) -> Any:
                if id(value) in _m:
                    return _m[id(value)][1]
                return nest.map_structure(lambda x: _m[id(x)][1] if id(x) in _m else x, value)

            try:
                for thunk, old in self._log:
                    new = thunk(substitute)
                    mapping[id(old)] = (old, new)
                    mapping.update(_pairs(old, new))
            except BaseException as e:
                if not self._broken():
                    raise
                error = e
                continue
            return substitute
        raise errors.AbortedError(f"elastic: {_MAX_REFORMS} re-forms in a row for one step")

    # -- re-forming ------------------------------------------------------------------------
    def _recover_until_formed(self, error: BaseException) -> Decision:
        """Puts the snapshot back, agrees on the group, forms its ring, takes the source's state."""
        previous = self.view
        old_replicas = self.num_replicas
        task = error.task if isinstance(error, errors.OpError) else None
        suspects = {int(m) for m in _TASK.findall(task or "")}
        log.warning(
            "worker:%d: the ring of generation %d broke (%s); re-forming",
            self.me,
            self.view.generation,
            error,
        )
        for _ in range(_MAX_REFORMS):
            self._strategy._ring.close()
            if self._snapshot is not None:
                self.state.restore(self._snapshot)
            decision = agree(
                self.door,
                self.view,
                self.me,
                self._position,
                suspects,
                window=self.options.rendezvous_seconds,
                min_workers=self.options.min_workers,
            )
            self.door.set_generation(decision.view.generation)
            self.view = decision.view
            try:
                self._form()
                self.state.broadcast(self._strategy._ring, decision.view.rank_of(decision.source))
            except errors.OpError as e:
                if not self._broken():
                    raise
                suspects = {int(m) for m in _TASK.findall(str(e.task or ""))}
                continue
            break
        else:
            raise errors.AbortedError(f"elastic: {_MAX_REFORMS} failed re-forms in a row")
        self.completed = decision.resume.completed
        self._position = decision.resume
        self._snapshot = self.state.snapshot()
        self._stepped = False
        self._announce(previous, "lost", old_replicas)
        return decision

    def _form(self) -> None:
        """Connects the ring of :attr:`view` and makes it the strategy's."""
        from psflow.distribute.multi_worker_mirrored_strategy import WorkerGroup

        strategy = self._strategy
        view = self.view
        links = None
        if len(view.members) > 1:
            links = PeerLinks(
                view.rank_of(self.me),
                view.member_addresses(),
                self.door.security,
                silence_seconds=self.timeout,
                generation=view.generation,
                ids=list(view.members),
                incoming=self.door.take_ring,
            )
            try:
                links.connect(min(self.timeout, 2 * self.options.rendezvous_seconds))
            except BaseException:
                links.close()
                strategy._ring = CrossHostRing(links, self.timeout)  # broken: a re-form follows
                raise
        strategy._ring = CrossHostRing(links, self.timeout)
        group = strategy._group
        strategy._group = WorkerGroup(
            tuple(view.member_addresses()), view.rank_of(self.me), group.task_type, group.task_id
        )
        strategy._reset_collectives()

    def _drain(self, leaving: list[int]) -> None:
        """Everyone passed the barrier: the group goes on without ``leaving``."""
        previous = self.view
        old_replicas = self.num_replicas
        members = tuple(m for m in self.view.members if m not in leaving)
        for listener in list(self._drain_listeners):
            listener(leaving)
        self._strategy._ring.close()
        if self.me in leaving:
            log.warning("worker:%d drained after step %d", self.me, self.completed)
            self.door.close()
            raise SystemExit(0)
        if len(members) < self.options.min_workers:
            raise errors.UnavailableError(
                f"workers {leaving} drained: {len(members)} are left, min_workers is "
                f"{self.options.min_workers}"
            )
        self.view = View(self.view.generation + 1, members, self.view.addresses)
        self.door.set_generation(self.view.generation)
        self._form()
        self._announce(previous, "drained", old_replicas)

    def _announce(self, previous: View, reason: str, old_replicas: int) -> None:
        new_replicas = self.num_replicas
        scale = 1.0 if self.batch_policy is BatchPolicy.KEEP_GLOBAL else new_replicas / old_replicas
        change = MembershipChange(
            generation=self.view.generation,
            members=self.view.members,
            previous_members=previous.members,
            reason=reason,
            resumed_step=self.completed,
            num_replicas_in_sync=new_replicas,
            global_batch_scale=scale,
        )
        self.changes.append(change)
        log.warning(
            "worker:%d: generation %d: members %s (%s), resuming at step %d",
            self.me,
            change.generation,
            list(change.members),
            reason,
            change.resumed_step,
        )
        for listener in list(self._listeners):
            listener(change)

    def close(self) -> None:
        """Stops listening."""
        self.door.close()
