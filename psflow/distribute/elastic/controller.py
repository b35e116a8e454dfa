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

A worker that starts while its group already trains (a restarted one) asks
the group's rank 0 to admit it (:func:`~psflow.collective.membership.ask_to_join`);
rank 0 says so in the next barrier that a step follows (never at an epoch's
end: the joiner would have nothing to train), every member adds it to the next
generation, and the joiner receives the state before its program creates
its variables (:class:`.state.TrainingState` keeps it pending), then takes
the next step with the others (:attr:`initial_epoch` says which epoch).

A new worker (the job scaled up: its ``TF_CONFIG`` lists more workers than
the group's) joins the same way, up to ``max_workers``: its request names its
address, and when rank 0 admits a worker beyond the group's address table the
barrier says so and rank 0 broadcasts the new table (:meth:`_new_table`), so
every member can dial it now and find it in later re-forms.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from psflow import errors
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.door import Door, error_frame, send_json
from psflow.collective.membership import (
    Decision,
    Position,
    StaleGenerationError,
    View,
    agree,
    ask_to_join,
    decision_message,
    running_view,
)
from psflow.collective.peer_link import PeerLinks, split_address
from psflow.distribute.elastic.options import BatchPolicy, ElasticOptions, MembershipChange
from psflow.distribute.elastic.state import TrainingState
from psflow.util import nest

__all__ = ["ElasticController"]

log = logging.getLogger("psflow.elastic")
_TASK = re.compile(r"worker:(\d+)")
_MAX_REFORMS = 16  # re-forms in a row for one call before giving up (each is bounded)


def _same(value: Any) -> Any:
    return value


def _is_address(address: Any) -> bool:
    """Whether ``address`` reads as ``host:port``."""
    try:
        split_address(address)
    except (errors.OpError, TypeError, ValueError, AttributeError):
        return False
    return True


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
        self.initial_epoch = 0
        self.initial_workers = len(view.addresses)  # a joiner learns the group's on admission
        self.max_workers = options.most_workers(len(view.addresses))
        self._start: Position | None = None  # a joiner's first position, for its first iterator
        self.door.set_generation(view.generation, view.members, view.addresses)
        self._install_drain_handler()
        # hybrid mode: the table pushes, issued once a step is committed (psflow.distribute.hybrid)
        self.hybrid: Any = None

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
    def initial_replicas(self) -> int:
        """Replicas of the group as ``TF_CONFIG`` lists it (the per-replica batch is fixed by it)."""
        return self.initial_workers * len(self._strategy._devices)

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
        n = len(self.view.addresses)
        # [drains by worker id, admissions by worker id, workers beyond the address table]
        flags = np.zeros(2 * n + 1, np.int64)
        if self.draining:
            flags[self.me] = 1
        # rank 0 admits only where a step follows: a joiner admitted at an epoch's end would
        # resume with no step left, and its optimizers, never updated, would never take the
        # group's step count and slots (it ended reporting 0 iterations).  Its request waits
        # for the next epoch's first barrier; when training ends there, the door's close
        # fails its wait with a typed error.
        admits = self._admissions() if self.rank == 0 and iterator.has_step() else {}
        for member in admits:
            if member < n:
                flags[n + member] = 1
            else:
                flags[2 * n] += 1
        addresses = self.view.addresses
        try:
            (flags,) = self._strategy._ring.all_reduce([flags])
            if flags[2 * n] > 0:
                addresses = self._new_table(admits)
            if self.hybrid is not None:  # every member finished the last step: push it
                self.hybrid.committed(self.completed, self._strategy._ring)
        except BaseException as e:
            if not self._broken():
                raise
            return self._resume_after(e, iterator)
        leaving = [m for m in range(n) if flags[m] > 0]
        joining = [m for m in range(n) if flags[n + m] > 0]
        joining += [m for m in range(n, len(addresses)) if addresses[m]]  # beyond the old table
        if leaving or joining:
            try:
                self._change(leaving, joining, {m: s for m, (s, _) in admits.items()}, addresses)
            except errors.OpError as e:
                # the new ring or the joiner's state broadcast broke (a joiner died while it
                # was admitted): the members re-form without it from this boundary
                if not self._broken():
                    raise
                return self._resume_after(e, iterator)
        return True

    def _resume_after(self, error: BaseException, iterator: Any) -> bool:
        """The barrier's ring broke: re-form, and cut the resumed step for the new group."""
        decision = self._recover_until_formed(error)
        going_on = iterator.resume_at(decision.resume)
        self._skip_barrier = not going_on  # the next epoch's first barrier is passed too
        return going_on

    def _new_table(self, admits: dict[int, tuple[Any, str]]) -> tuple[str, ...]:
        """Every member: rank 0's address table with the admitted workers beyond the old one
        (a broadcast of its JSON: its length, then its bytes)."""
        ring = self._strategy._ring
        table = list(self.view.addresses)
        if self.rank == 0:
            for member, (_, address) in sorted(admits.items()):
                table.extend([""] * (member + 1 - len(table)))
                table[member] = address
        raw = np.frombuffer(json.dumps(table).encode(), np.uint8)
        (size,) = ring.broadcast([np.array([raw.size], np.int64)], root=0)
        (raw,) = ring.broadcast([raw if self.rank == 0 else np.empty(int(size[0]), np.uint8)])
        return tuple(json.loads(raw.tobytes().decode()))

    def _admissions(self) -> dict[int, tuple[Any, str]]:
        """Rank 0: the queued requests to join this generation that fit under max_workers
        (each with the address the worker gave)."""
        room = self.max_workers - len(self.view.members)
        admitted: dict[int, tuple[Any, str]] = {}
        for stream, message in self.door.take_admits():
            member = message["id"]
            address = message.get("address")
            known = self.view.addresses[member] if member < len(self.view.addresses) else None
            if message["generation"] != self.view.generation:
                error_frame(
                    stream,
                    errors.Code.ABORTED,
                    f"the group is at generation {self.view.generation}",
                )
            elif member in self.view.members or member in admitted or len(admitted) >= room:
                error_frame(
                    stream,
                    errors.Code.RESOURCE_EXHAUSTED,
                    f"worker:{member} cannot join: members {list(self.view.members)}, "
                    f"max_workers {self.max_workers}",
                )
            elif known is None and not _is_address(address):
                error_frame(
                    stream,
                    errors.Code.INVALID_ARGUMENT,
                    f"worker:{member} is beyond the group's {len(self.view.addresses)} workers "
                    f"and must name its host:port, got {address!r}",
                )
            else:
                admitted[member] = (stream, known or address)
                continue
            stream.close()
        return admitted

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
            self.door.set_generation(
                decision.view.generation, decision.view.members, decision.view.addresses
            )
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
        if self.hybrid is not None:  # the last committed step's pushes, all of them, once
            self.hybrid.reformed(self.completed)
        self._announce(previous, "lost")
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

    def _change(
        self,
        leaving: list[int],
        joining: list[int],
        admits: dict[int, Any],
        addresses: tuple[str, ...],
    ) -> None:
        """Everyone passed the barrier: the group goes on without ``leaving``, with ``joining``
        (``addresses``: every worker's, by id, the joiners' included)."""
        previous = self.view
        stay = [m for m in previous.members if m not in leaving]
        if not stay:  # every member drains (the whole job is being stopped): nobody to join
            joining = []
            for stream in admits.values():
                error_frame(stream, errors.Code.UNAVAILABLE, "every member of the group drains")
                stream.close()
            admits = {}
        members = tuple(sorted({*stay, *joining}))
        view = View(previous.generation + 1, members, addresses)
        source = stay[0] if stay else self.me
        decision = Decision(view, self._position, source, self.initial_workers)
        for stream in admits.values():  # rank 0 tells the joiners (before it may leave)
            with contextlib.suppress(OSError):  # gone: the new ring fails and the others re-form
                send_json(stream, decision_message(decision))
            stream.close()
        if leaving:
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
        self.view = view
        self.door.set_generation(view.generation, view.members, view.addresses)
        # every member decided this change at the barrier: all announce it, even one whose
        # new ring then breaks (it announces the re-form after it, as the others do)
        self._announce(previous, "joined" if joining and not leaving else "drained")
        self._form()
        if joining:
            self.state.broadcast(self._strategy._ring, view.rank_of(decision.source))

    def join(self, view: View) -> None:
        """This worker started while ``view``'s group trains: it asks to join and is admitted.

        Raises:
            StaleGenerationError / UnavailableError: the group could not take it.
        """
        wait = self.timeout + 2 * self.options.rendezvous_seconds
        for _ in range(_MAX_REFORMS):
            try:
                decision = ask_to_join(self.door, view, self.me, wait)
                break
            except StaleGenerationError:  # the group changed meanwhile: ask its new rank 0
                newer = running_view(self.door, view.addresses, self.me)
                if newer is None:
                    raise
                view = newer
        else:
            raise errors.AbortedError(f"elastic: {_MAX_REFORMS} tries to join in a row")
        previous = View(0, (self.me,), view.addresses)
        self.view = decision.view
        self.initial_workers = decision.initial_workers or self.initial_workers
        self.door.set_generation(
            decision.view.generation, decision.view.members, decision.view.addresses
        )
        self._form()
        self.state.broadcast(
            self._strategy._ring, decision.view.rank_of(decision.source), pending=True
        )
        self.completed = decision.resume.completed
        self._position = decision.resume
        self._start = decision.resume
        self.initial_epoch = max(decision.resume.epoch, 0)
        self._skip_barrier = True  # the members passed the barrier that admitted it
        self._announce(previous, "joined")

    def take_start(self) -> Position | None:
        """A joiner's first position (once): where its first epoch's iterator starts."""
        start, self._start = self._start, None
        return start

    def _announce(self, previous: View, reason: str) -> None:
        """Records the change from ``previous`` to :attr:`view` and tells the listeners.

        The replica counts come from the two views, not from the ring: a member
        announces a decided change before it connects the new ring, so one whose
        connection then fails has told its listeners the same as the others.
        """
        devices = len(self._strategy._devices)
        old_replicas = len(previous.members) * devices
        new_replicas = len(self.view.members) * devices
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
