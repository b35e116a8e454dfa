"""Resizing the parameter servers under a session: move variables, bump the map, drain.

:func:`resize` runs between training steps (the coordinator fences it at a
step boundary: no closure is in flight, so no push can race a move).  Phases:

1. **connect** the tasks added (and wait until each answers);
2. **plan** the moves (:func:`~psflow.distribute.ps.placement.plan_resize`:
   the fewest that leave the tasks balanced by bytes);
3. **move** them in batches, each from one old owner to one new owner:
   export (a copy: value, slots, versions, optimizer step, sync step, push
   records), import at the new owner, release at the old one, which from then
   on answers ``MovedError`` naming the new owner.  A variable is unavailable
   only from its export to its release (the *fence*, per batch, not global).
   After every batch the session's map says where each variable is, so a
   failure part way (a PS killed) leaves a consistent map for the checkpoint
   recovery to restore into;
4. **the rest** moves: each step the session registered
   (``on_resize``: dynamic embedding tables re-shard there);
5. **drain** the tasks removed: each is told to exit (it prints
   ``PSFLOW_DRAINED`` and exits 0) and its connection is closed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from psflow import errors
from psflow.distribute.ps import recovery
from psflow.distribute.ps.placement import Move, ResizeReport, plan_resize

__all__ = ["BATCH_BYTES", "resize"]

log = logging.getLogger("psflow.distribute")

BATCH_BYTES = 4 << 20
"""Value bytes moved per export/import call (slots ride along: a batch can be a few times more)."""


def _batches(moves: Sequence[Move], sizes: Mapping[str, int]) -> list[tuple[int, int, list[str]]]:
    """``(source, target, keys)`` groups of at most :data:`BATCH_BYTES` (one key at least)."""
    out: list[tuple[int, int, list[str]]] = []
    groups: dict[tuple[int, int], list[str]] = {}
    for m in moves:
        groups.setdefault((m.source, m.target), []).append(m.key)
    for (source, target), keys in groups.items():  # plan order: deterministic
        batch: list[str] = []
        held = 0
        for key in keys:
            size = sizes.get(key, 1)
            if batch and held + size > BATCH_BYTES:
                out.append((source, target, batch))
                batch, held = [], 0
            batch.append(key)
            held += size
        out.append((source, target, batch))
    return out


def _left(deadline: float) -> float:
    """Seconds to ``deadline`` (a little at least: the call then fails with its deadline)."""
    return max(deadline - time.monotonic(), 0.001)


def resize(
    session: Any,
    addresses: Sequence[str],
    *,
    timeout: float = 300.0,
    probe_timeout: float = recovery.DEFAULT_PROBE_TIMEOUT,
    before_drain: Callable[[float], None] | None = None,
) -> ResizeReport:
    """Moves ``session``'s variables onto the tasks at ``addresses`` (tasks ``0..n-1``).

    Args:
        session: the chief's :class:`~psflow.distribute.ps.session.PSSession`.
        addresses: the tasks after the resize; those already connected must
            keep their addresses.
        timeout: seconds for the whole resize (finite).
        probe_timeout: deadline of one readiness probe of an added task.
        before_drain: called with the deadline (``time.monotonic()`` clock)
            once every variable moved, before removed tasks are told to exit:
            the coordinator makes every worker take the new map there, so no
            worker still routes to a task that is gone.

    Raises:
        InvalidArgumentError: no address, or a kept task at another address.
        UnavailableError, DeadlineExceededError: a task involved is lost or
            slow; the map then holds every move completed so far.
    """
    if session.resize_blockers:
        raise errors.UnimplementedError(
            f"cannot resize the parameter servers: {'; '.join(sorted(session.resize_blockers))}"
        )
    if not 0 < timeout < float("inf"):
        raise errors.InvalidArgumentError(f"resize timeout {timeout!r} must be finite and > 0")
    start = time.monotonic()
    deadline = start + timeout
    addresses = tuple(addresses)
    old = session.placement
    old_n, new_n = len(session.connections), len(addresses)
    if new_n < 1:
        raise errors.InvalidArgumentError("cannot resize to 0 parameter servers")
    for i in range(min(old_n, new_n)):
        if session.connections[i].address != addresses[i]:
            raise errors.InvalidArgumentError(
                f"ps:{i} is at {session.connections[i].address}, the new layout puts it at "
                f"{addresses[i]}; a resize keeps the tasks it does not add or remove"
            )
    # a resize that failed part way is resumed: the tasks it added still count as added
    origin = session.resize_origin if session.resize_origin is not None else old_n
    session.resize_origin = origin
    # 1. connect the tasks added
    if new_n > old_n:
        session.adopt_tasks(addresses)
        for c in session.connections[old_n:]:
            progress = recovery.Progress(
                f"{session.task} waits for the added parameter server {c.task}",
                timeout,
                recovery.DEFAULT_PROGRESS_INTERVAL,
                log,
            )
            recovery.wait_until(c.task, c.probe, deadline, progress, probe_timeout)
    # 2. plan
    sizes = session.variable_sizes()
    moves = plan_resize(old, new_n, sizes, first_added=origin)
    version = old.version + 1
    connections = list(session.connections)
    # 3. move, batch by batch; the map follows every completed batch
    bytes_moved, longest = 0, 0.0
    for source, target, keys in _batches(moves, sizes):
        if time.monotonic() > deadline:
            raise errors.DeadlineExceededError(
                f"resizing to {new_n} parameter servers took more than {timeout}s "
                f"({bytes_moved} bytes moved)"
            )
        fence = time.monotonic()
        state = connections[source].export_shard(keys, _left(deadline))
        try:
            connections[target].import_shard(state, version, _left(deadline))
        except BaseException:
            # the old owner still holds the variables: it serves writes again
            with contextlib.suppress(errors.OpError):
                connections[source].cancel_export(keys, min(_left(deadline), 5.0))
            raise
        try:
            connections[source].release_shard(
                keys, target, addresses[target], version, _left(deadline)
            )
        except errors.MovedError as e:  # a retried release that had gone through
            if e.owner != target:
                raise
        except errors.OpError:
            # not released: the old owner still holds them (the map says so); unfence
            with contextlib.suppress(errors.OpError):
                connections[source].cancel_export(keys, min(_left(deadline), 5.0))
            raise
        longest = max(longest, time.monotonic() - fence)
        bytes_moved += len(state)
        session.moved({k: target for k in keys}, version)
    # 4. what the map does not cover (dynamic tables) moves, then the tasks removed drain
    for step in list(session.resize_steps):
        step(addresses, deadline)
    session.announce_tasks(addresses, version)  # the map the workers take lists the rest
    if before_drain is not None:
        before_drain(deadline)
    for c in connections[new_n:]:
        c.drain(_left(deadline))
    session.adopt_tasks(addresses, version=version)
    session.resize_origin = None
    report = ResizeReport(
        old_num_ps=old_n,
        new_num_ps=new_n,
        version_before=old.version,
        version_after=session.placement.version,
        bytes_moved=bytes_moved,
        shards_moved=len(moves),
        seconds=time.monotonic() - start,
        longest_fence_seconds=longest,
    )
    log.info(
        "resized parameter servers %d -> %d: %d variables (%d bytes) moved in %.2fs, "
        "longest fence %.3fs, placement version %d",
        old_n,
        new_n,
        len(moves),
        bytes_moved,
        report.seconds,
        longest,
        report.version_after,
    )
    return report
