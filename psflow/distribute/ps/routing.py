"""How a session follows the placement map: which task holds a variable, redirects, resizes.

:class:`Routing` is a mixin of :class:`~psflow.distribute.ps.session.PSSession`
(it works on the session's connections and map).  Every pull and push is
grouped by the owner the session's map names; a task that answers
``MovedError`` (it gave the variable away) applied nothing, so the session
records the new owner, connects to it if needed, and sends that part again.
A resize (:mod:`psflow.distribute.ps.resize`) updates the map batch by
batch; workers take the chief's map before their next closure.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from psflow import errors
from psflow.distribute.ps.connection import PSConnection
from psflow.distribute.ps.placement import PlacementMap
from psflow.transport.started import Started, fan_out, gather, settle

__all__ = ["MAX_EXTRA_REDIRECTS", "Routing"]

log = logging.getLogger("psflow.distribute")

# a request is redirected (MovedError) at most this many times more than it names variables
MAX_EXTRA_REDIRECTS = 2


class Routing:
    """Placement-map routing of a PS session (see the module docstring).

    The session sets these in its constructor:
    """

    task: str
    connections: list[PSConnection]
    resize_blockers: set[str]
    resize_steps: list[Callable[[Sequence[str], float], None]]
    resize_origin: int | None
    _connect: Callable[[str, int], PSConnection] | None
    _placement_lock: threading.RLock
    _handles: dict[str, Any]
    _handles_lock: threading.Lock
    _pool: Any

    def _invalidate(self) -> None:
        raise NotImplementedError  # the session's

    # The map is kept as plain fields (creating a variable adds one owner, not a copy
    # of the map) and frozen into a PlacementMap when asked for, once per change: the
    # same object for every handle pickled into one closure (pickled once).
    _owners: dict[str, int]
    _version: int
    _addresses: tuple[str, ...]
    _frozen: PlacementMap | None

    @property
    def placement(self) -> PlacementMap:
        """The current map (a frozen snapshot)."""
        frozen = self._frozen
        if frozen is None:
            with self._placement_lock:
                frozen = self._frozen = PlacementMap(self._version, self._owners, self._addresses)
        return frozen

    @placement.setter
    def placement(self, value: PlacementMap) -> None:
        self._owners = dict(value.owners)
        self._version = value.version
        self._addresses = tuple(value.addresses)
        self._frozen = value

    def owner(self, key: str, default: int) -> int:
        """The task holding ``key`` by this session's map (``default`` if not in it)."""
        return self._owners.get(key, default)

    def place(self, owners: Mapping[str, int]) -> None:
        """Records where new variables were created (the map's version stays)."""
        with self._placement_lock:
            self._owners.update(owners)
            self._frozen = None

    def adopt(self, placement: PlacementMap | None) -> None:
        """Takes a newer map (a closure from the chief carries it); older ones are ignored.

        Connections follow the map's addresses: tasks added are connected,
        tasks removed are closed.
        """
        if placement is None or placement.version < self.placement.version:
            return
        with self._placement_lock:
            if placement.version < self.placement.version or placement is self.placement:
                return
            self._set_tasks(placement.addresses)
            self.placement = PlacementMap(
                placement.version, {**self.placement.owners, **placement.owners},
                placement.addresses,
            )  # fmt: skip

    def refuse_resize(self, reason: str) -> None:
        """Makes a later resize fail with ``UnimplementedError`` giving ``reason``."""
        self.resize_blockers.add(reason)

    def on_resize(self, step: Callable[[Sequence[str], float], None]) -> None:
        """Has a resize call ``step(addresses, deadline)`` once the variables moved.

        For state the session's map does not cover (dynamic embedding tables):
        ``step`` moves it onto the tasks at ``addresses`` before removed tasks
        drain, at a step boundary (the coordinator fences such a resize).
        """
        self.resize_steps.append(step)

    def connect_with(self, connect: Callable[[str, int], PSConnection]) -> None:
        """Sets how tasks added by a resize are reached: ``connect(address, task_index)``."""
        self._connect = connect

    def adopt_tasks(self, addresses: Sequence[str], version: int | None = None) -> None:
        """Connects to exactly the tasks at ``addresses`` (a resize's first or last phase)."""
        with self._placement_lock:
            self._set_tasks(addresses)
            self.placement = self.placement.with_owners(
                {}, addresses=tuple(addresses), version=version
            )
        self._invalidate()

    def moved(self, owners: Mapping[str, int], version: int) -> None:
        """Records variables a resize moved (``key -> task``) under map ``version``."""
        with self._placement_lock:
            self.placement = self.placement.with_owners(owners, version=version)
        self._invalidate()

    def announce_tasks(self, addresses: Sequence[str], version: int) -> None:
        """Puts ``addresses`` in the map the workers take, keeping this session's connections.

        A shrinking resize tells the workers the remaining tasks (their table
        clients hash ids by that count) while it still needs the removed
        tasks' connections to drain them.
        """
        with self._placement_lock:
            self.placement = self.placement.with_owners(
                {}, addresses=tuple(addresses), version=version
            )

    def variable_sizes(self) -> dict[str, int]:
        """Bytes of every variable this session knows (a resize balances by them)."""
        with self._handles_lock:
            return {k: int(h.nbytes) for k, h in self._handles.items()}

    def _set_tasks(self, addresses: Sequence[str]) -> None:
        """Makes ``self.connections`` reach exactly ``addresses`` (tasks 0..n-1)."""
        for i, address in enumerate(addresses):
            if i < len(self.connections) and self.connections[i].address == address:
                continue
            if self._connect is None:
                raise errors.FailedPreconditionError(
                    f"{self.task} cannot reach ps:{i} at {address}: this session has no "
                    "way to connect to new parameter servers"
                )
            connection = self._connect(address, i)
            if i < len(self.connections):
                self.connections[i].close()
                self.connections[i] = connection
            else:
                self.connections.append(connection)
        for gone in self.connections[len(addresses) :]:
            gone.close()
        del self.connections[len(addresses) :]
        if self._pool is None and len(self.connections) > 1:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=len(self.connections), thread_name_prefix="ps-call"
            )

    def _learn(self, moved: errors.MovedError) -> None:
        """Follows one redirect: ``moved.key`` is on ``moved.owner`` now.

        Raises:
            FailedPreconditionError: the redirect names a task this session
                cannot reach (no address for the tasks before it).
        """
        with self._placement_lock:
            addresses = list(self.placement.addresses)
            if moved.owner < 0 or moved.owner > len(addresses):
                raise errors.FailedPreconditionError(
                    f"{moved.key!r} moved to ps:{moved.owner}, but {self.task} knows only "
                    f"{len(addresses)} parameter servers; it needs the chief's placement map"
                ) from moved
            if moved.owner == len(addresses):
                addresses.append(moved.address)
            elif moved.address and addresses[moved.owner] != moved.address:
                addresses[moved.owner] = moved.address
            self._set_tasks(addresses)
            self.placement = self.placement.with_owners(
                {moved.key: moved.owner}, addresses=tuple(addresses)
            )
        log.info("%s: %s moved to ps:%d (%s)", self.task, moved.key, moved.owner, moved.address)

    @staticmethod
    @contextlib.contextmanager
    def _starting(
        handles: Sequence[Any],
    ) -> Iterator[tuple[dict[int, list[Any]], dict[int, Started | None]]]:
        """``(by_ps, calls)``: ``handles`` grouped by owner, and the dict a loop
        starts one call per owner into.  A start that raises lets the calls sent
        before it finish first (``gather``'s rule)."""
        by_ps = _by_owner(handles)
        calls: dict[int, Started | None] = {}
        try:
            yield by_ps, calls
        except BaseException:
            settle(c for c in calls.values() if c is not None)
            raise

    def _answers(
        self,
        calls: Mapping[int, Started | None],
        by_ps: Mapping[int, list[Any]],
        call: Callable[[int, list[Any], int], Any],
        start: Callable[[int, list[Any], int], Any] | None = None,
    ) -> list[tuple[list[Any], Any]]:
        """``[(handles, reply), ...]`` of one call per owner the caller started itself
        (the common case: every owner's data plane known, no redirect).

        ``calls[ps]`` is ``by_ps[ps]``'s call, or None where it could not be
        started: those handles go the general way, :meth:`_routed`, as do the
        handles of a task that answered ``MovedError`` (from attempt 1, so that
        exactly-once ids tell the resend apart).  Every call sent finishes
        before an error propagates, and the error is the first in ``calls``'
        order (:func:`~psflow.transport.started.gather`'s rule).
        """
        sent = [(ps, c) for ps, c in calls.items() if c is not None]
        rest = [h for ps, c in calls.items() if c is None for h in by_ps[ps]]
        moved: list[Any] = []
        learn: list[errors.MovedError] = []
        done = 0
        try:
            replies = list(self._routed(rest, call, start).values()) if rest else []
            for ps, started in sent:
                done += 1
                try:
                    replies.append((by_ps[ps], started.result()))
                except errors.MovedError as e:  # a value: the other calls finish
                    learn.append(e)
                    moved += by_ps[ps]
        except BaseException:
            settle(c for _, c in sent[done:])
            raise
        for e in learn:
            self._learn(e)
        if moved:  # applied nowhere: sent again under a fresh id (attempt 1 on)
            replies += self._routed(moved, call, start, first_attempt=1).values()
        return replies

    def _routed(
        self,
        handles: Sequence[Any],
        call: Callable[[int, list[Any], int], Any],
        start: Callable[[int, list[Any], int], Any] | None = None,
        first_attempt: int = 0,
    ) -> dict[int, tuple[list[Any], Any]]:
        """Runs ``call(ps, handles_there, attempt)`` once per owning task, following redirects.

        ``start(ps, handles_there, attempt)``, where given, sends that call now
        and returns it started, or None (see :func:`~psflow.transport.started.fan_out`).

        A task that answers ``MovedError`` applied nothing of that call: its
        handles are regrouped by the updated map and sent again (``attempt``
        counts the resends, so exactly-once ids can tell them apart; from
        ``first_attempt``, for handles redirected once already).

        Returns:
            ``{(ps, attempt): (handles, result)}`` of every call that succeeded.
        """
        results: dict[Any, tuple[list[Any], Any]] = {}
        pending = list(handles)
        attempts = len(handles) + MAX_EXTRA_REDIRECTS
        for attempt in range(first_attempt, first_attempt + attempts):
            by_ps = _by_owner(pending)
            work = {ps: functools.partial(call, ps, hs, attempt) for ps, hs in by_ps.items()}
            starts = {}
            if start is not None:
                starts = {ps: functools.partial(start, ps, hs, attempt) for ps, hs in by_ps.items()}
            pending = []
            # a redirect is a value, so the other tasks' calls finish
            calls = fan_out(starts, work, self._pool)
            for ps, result in gather(calls, errors.MovedError).items():
                if isinstance(result, errors.MovedError):
                    self._learn(result)
                    pending += by_ps[ps]
                else:
                    results[(ps, attempt)] = (by_ps[ps], result)
            if not pending:
                return results
        raise errors.AbortedError(
            f"{self.task}: {[h.key for h in pending][:5]} kept being redirected "
            f"({attempts} attempts)"
        )


def _by_owner(handles: Sequence[Any]) -> dict[int, list[Any]]:
    """``handles`` grouped by the PS task that owns each (``ps_index``), in order."""
    by_ps: dict[int, list[Any]] = {}
    for h in handles:
        by_ps.setdefault(h.ps_index, []).append(h)
    return by_ps
