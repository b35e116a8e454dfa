"""How the survivors of a broken ring agree on the next generation's members.

A *view* is a numbered generation and its members (stable worker ids, in
ring order).  When a collective of generation ``G`` fails (a peer died, froze
past the silence timeout, or is cut off), every survivor runs :func:`agree`:

1. **Leader**: the lowest-ranked member of ``G`` whose door answers.  A
   survivor asks each lower-ranked member in turn (a ``join`` connection to
   its :class:`~.door.Door`): a dead one refuses at once, a frozen one does
   not answer within ``probe_seconds`` and is skipped; if none answers, it
   leads.  A member asked while it follows another leader answers with a
   redirect to that leader.
2. **Joining**: each follower sends the leader its *position*: how many
   steps it completed (its state was rolled back to the last step boundary),
   its epoch and the example offset of its next step, and the peers it
   suspects.  The leader waits until every member nobody suspects has
   joined, or ``window`` seconds.
3. **Decision**: members = the leader and whoever joined, in the old ring
   order; generation ``G + 1``; the resume position is the smallest
   ``completed`` reported (the ring's collectives make the survivors differ by
   at most one step: a worker cannot finish a step's last collective, or pass
   the next step boundary, without every other worker having reached it) and
   its *source* the first member at that position, whose state every member
   receives once the new ring is up.  The decision goes to every joiner;
   fewer than ``min_workers`` members is an ``UnavailableError`` for all.

Failure cases, stated: a member that dies during the agreement or before the
new ring connects makes that ring fail, and the survivors agree again from
``G + 1`` (each agreement is bounded by its deadline).  A member nobody
hears from within ``window`` is left out; if it was alive (frozen for longer
than the window, or partitioned), its next contact is refused with
:class:`StaleGenerationError`.  A network partition that leaves two sides
each able to reach its own lowest member forms two groups: set
``min_workers`` above half the workers to make the minority side stop
instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import ssl
import time
from collections.abc import Iterable
from typing import Any

from psflow import errors
from psflow.collective.door import Door, RemoteError, error_frame, read_json, send_json
from psflow.collective.peer_link import split_address
from psflow.errors import Code
from psflow.security.config import SecurityConfig
from psflow.transport.dataplane import auth, frames
from psflow.transport.dataplane.stream import FrameStream, tune

__all__ = [
    "Decision",
    "Position",
    "StaleGenerationError",
    "View",
    "agree",
    "ask_view",
    "ask_to_join",
    "decision_message",
    "running_view",
]


class StaleGenerationError(errors.AbortedError):
    """This worker belongs to a generation the group has left behind (it was dropped)."""


@dataclasses.dataclass(frozen=True)
class View:
    """One generation of the group.

    Attributes:
        generation: its number (0 at the start, +1 at every change).
        members: the members' stable ids, in ring order.
        addresses: every worker's ``host:port``, indexed by id (members or not).
    """

    generation: int
    members: tuple[int, ...]
    addresses: tuple[str, ...]

    def rank_of(self, member: int) -> int:
        """``member``'s index in the ring."""
        return self.members.index(member)

    def member_addresses(self) -> list[str]:
        """The members' addresses, in ring order."""
        return [self.addresses[m] for m in self.members]


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a worker's training stands at its last step boundary.

    Attributes:
        completed: steps it completed since the start (all epochs).
        epoch: the epoch of its input iterator (-1: none yet).
        offset: examples of that epoch taken before its next step.
    """

    completed: int
    epoch: int = -1
    offset: int = 0

    def as_dict(self) -> dict[str, int]:
        """The JSON form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The outcome of an agreement: the new view, where to resume, from whose state.

    ``initial_workers``: how many workers the group started with (its per-replica
    batch is cut for them); 0 where the receiver knows it already (a re-form).
    """

    view: View
    resume: Position
    source: int
    initial_workers: int = 0


def _int(message: dict[str, Any], key: str) -> int:
    value = message.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise errors.InvalidArgumentError(f"re-form message: {key!r} must be an integer")
    return value


def _position(message: dict[str, Any]) -> Position:
    return Position(_int(message, "completed"), _int(message, "epoch"), _int(message, "offset"))


class _Refused(Exception):
    def __init__(self, error: errors.OpError) -> None:
        self.error = error


class _Redirect(Exception):
    def __init__(self, leader: int) -> None:
        self.leader = leader


def _dial(
    security: SecurityConfig, address: str, client: str, deadline: float, who: str
) -> FrameStream:
    host, port = split_address(address)
    left = max(deadline - time.monotonic(), 0.001)
    try:
        sock = socket.create_connection((host, port), timeout=left)
    except OSError as e:
        raise errors.UnavailableError(f"{who} is unreachable: {e}") from None
    try:
        tune(sock)
        sock.settimeout(left)
        tls = security.tls
        if tls is not None:
            sock = auth.client_context(tls).wrap_socket(
                sock, server_hostname=tls.server_name or host
            )
        stream = FrameStream(sock, max_header=auth.HELLO_LIMIT, max_payload=0)
        stream.send_frame(frames.Kind.HELLO, header=auth.hello(security, client))
        stream.deadline = deadline
        head = stream.read_head()
        header = stream.read_bytes(head.header_len)
        stream.deadline = None
    except (OSError, ssl.SSLError, frames.FrameError) as e:
        with contextlib.suppress(OSError):
            sock.close()
        if isinstance(e, TimeoutError):
            raise errors.DeadlineExceededError(f"{who} did not answer in time") from None
        raise errors.UnavailableError(f"{who} is unavailable: {e}") from None
    if head.kind is frames.Kind.WELCOME:
        stream.max_header = frames.MAX_HEADER_BYTES
        return stream
    stream.close()
    from psflow.proto import dataplane_pb2

    status = dataplane_pb2.DataPlaneStatus.FromString(header)
    if status.code == Code.ABORTED.name:
        raise StaleGenerationError(f"{who} refused this worker: {status.message}")
    code = Code[status.code] if status.code in Code.__members__ else Code.UNKNOWN
    raise errors.error_class(code)(f"{who} refused this worker: {status.message}")


def _follow(
    door: Door,
    view: View,
    me: int,
    leader: int,
    position: Position,
    suspects: set[int],
    probe: float,
    wait: float,
) -> Decision:
    """Joins ``leader``; raises :class:`_Redirect`, or an OpError when it does not lead."""
    who = f"worker:{leader} at {view.addresses[leader]}"
    client = f"join:{me}/gen:{view.generation}"
    stream = _dial(door.security, view.addresses[leader], client, time.monotonic() + probe, who)
    try:
        send_json(stream, {**position.as_dict(), "suspects": sorted(suspects)})
        end = time.monotonic() + wait
        while True:
            # joins that reach this worker meanwhile go to the leader it follows
            for other, _ in door.take_joins():
                with contextlib.suppress(OSError):
                    send_json(other, {"redirect": leader})
                other.close()
            stream.settimeout(0.2)
            try:
                stream.wait_for_bytes()
                break
            except TimeoutError:
                if time.monotonic() > end:
                    raise errors.DeadlineExceededError(
                        f"{who} sent no decision in {wait:g}s"
                    ) from None
        try:
            message = read_json(stream, end + 1.0, who)
        except RemoteError as refused:  # the leader decided without this worker, or gave up
            if isinstance(refused.error, errors.AbortedError):
                raise StaleGenerationError(str(refused.error)) from None
            raise _Refused(refused.error) from None
    finally:
        stream.close()
    if "redirect" in message:
        raise _Redirect(_int(message, "redirect"))
    return _decision(message, view.addresses, who)


def _decision(message: dict[str, Any], addresses: tuple[str, ...], who: str) -> Decision:
    """The decision in ``message`` (:func:`decision_message`'s form), checked."""
    table = _extended(message, addresses)
    members = tuple(message.get("members", ()))
    if not members or not all(isinstance(m, int) and 0 <= m < len(table) for m in members):
        raise errors.InvalidArgumentError(f"{who} sent a malformed decision: {message!r}")
    return Decision(
        View(_int(message, "generation"), members, table),
        _position(message["resume"]),
        _int(message, "source"),
        _int(message, "initial_workers"),
    )


def _lead(
    door: Door,
    view: View,
    me: int,
    position: Position,
    suspects: set[int],
    window: float,
    min_workers: int,
) -> Decision:
    """Collects the joins, decides, and tells every joiner."""
    expected = set(view.members) - {me} - suspects
    joined: dict[int, tuple[FrameStream, Position]] = {}
    end = time.monotonic() + window
    while not expected <= joined.keys() and time.monotonic() < end:
        for stream, message in door.take_joins(min(0.2, max(end - time.monotonic(), 0.0))):
            member = message["id"]
            try:
                if message["generation"] != view.generation or member not in view.members:
                    raise errors.AbortedError(
                        f"worker:{member} of generation {message['generation']} is not a "
                        f"member of generation {view.generation}"
                    )
                joined[member] = (stream, _position(message))
                theirs = {s for s in message.get("suspects", []) if isinstance(s, int)}
                expected -= theirs - joined.keys()
            except errors.OpError as e:
                error_frame(stream, e.code, e.message)
                stream.close()
    members = tuple(m for m in view.members if m == me or m in joined)
    positions = {me: position, **{m: p for m, (_, p) in joined.items()}}
    try:
        for missing in (m for m in view.members if m not in members):
            # a member that went on without this one (it froze past the window) refuses the probe
            with contextlib.suppress(errors.UnavailableError, errors.DeadlineExceededError):
                who = f"worker:{missing} at {view.addresses[missing]}"
                client = f"probe:{me}/gen:{view.generation}"
                _dial(
                    door.security, view.addresses[missing], client, time.monotonic() + 1.0, who
                ).close()
        if len(members) < min_workers:
            raise errors.UnavailableError(
                f"only {len(members)} workers ({sorted(members)}) are left of generation "
                f"{view.generation}; min_workers is {min_workers}"
            )
        resume = min(p.completed for p in positions.values())
        source = next(m for m in members if positions[m].completed == resume)
        decision = Decision(
            View(view.generation + 1, members, view.addresses), positions[source], source
        )
        message = decision_message(decision)
        for stream, _ in joined.values():
            with contextlib.suppress(OSError):
                send_json(stream, message)
        return decision
    except errors.OpError as e:
        for stream, _ in joined.values():
            error_frame(stream, e.code, e.message)
        raise
    finally:
        for stream, _ in joined.values():
            stream.close()


def agree(
    door: Door,
    view: View,
    me: int,
    position: Position,
    suspects: Iterable[int] = (),
    *,
    window: float = 10.0,
    probe: float = 1.0,
    min_workers: int = 1,
) -> Decision:
    """Runs one agreement (see the module docstring); every survivor of ``view`` calls it.

    Raises:
        StaleGenerationError: the group went on without this worker.
        UnavailableError: fewer than ``min_workers`` members are left.
        DeadlineExceededError: no leader answered within the bounds.
    """
    suspected = {s for s in suspects if s != me}
    tried: set[int] = set()
    end = time.monotonic() + 3 * window + probe * len(view.members)
    candidates = list(view.members[: view.rank_of(me)])
    while candidates and time.monotonic() < end:
        leader = candidates.pop(0)
        if leader in tried:
            continue
        tried.add(leader)
        try:
            return _follow(door, view, me, leader, position, suspected, probe, 2 * window)
        except _Redirect as r:
            if r.leader != me and r.leader not in tried:
                candidates.insert(0, r.leader)
        except _Refused as r:
            raise r.error from None
        except StaleGenerationError:
            raise
        except errors.OpError:
            suspected.add(leader)
    return _lead(door, view, me, position, suspected, window, min_workers)


# -- a worker (re)joining a running group ---------------------------------------------------
def running_view(door: Door, addresses: tuple[str, ...], me: int) -> View | None:
    """The view of a group that already trains (generation > 0), or None at a fresh start.

    Every other worker's door is asked (``view``); one that answers at
    generation 0 with this worker among its members (or with none yet), or
    none answering, means the group is starting.  The view's
    address table is the group's, extended by this worker's own ``addresses``
    beyond it: a worker started with a longer ``TF_CONFIG`` list than the
    group's (the job scaled up) is known to the group by the address it sends.
    """
    for other in range(len(addresses)):
        if other == me:
            continue
        who = f"worker:{other} at {addresses[other]}"
        try:
            stream = _dial(
                door.security, addresses[other], f"view:{me}/gen:0", time.monotonic() + 1.0, who
            )
        except errors.OpError:
            continue
        try:
            message = read_json(stream, time.monotonic() + 2.0, who)
        except (errors.OpError, RemoteError):
            continue
        finally:
            stream.close()
        generation = _int(message, "generation")
        members = tuple(m for m in message.get("members", ()) if isinstance(m, int))
        # a door names its members once its group's ring is up: a group that left this
        # worker out (generation > 0), or formed without it (the job scaled up), trains
        if members and (generation > 0 or me not in members):
            return View(generation, members, _extended(message, addresses))
    return None


def ask_view(address: str, security: SecurityConfig, timeout: float = 1.0) -> View:
    """The view of the worker whose door is at ``address``: its generation, its
    members (empty until its first ring is up) and the group's address table.

    For observers (``psflow local``'s dashboard): the door answers a ``view``
    whatever its generation, and it answers from its own threads, so a worker
    busy computing answers too.

    Raises:
        UnavailableError, DeadlineExceededError: nothing answers there in ``timeout``.
        InvalidArgumentError: the answer is not a view.
    """
    deadline = time.monotonic() + timeout
    who = f"the worker at {address}"
    stream = _dial(security, address, "view:0/gen:0", deadline, who)
    try:
        message = read_json(stream, deadline, who)
    except RemoteError as e:
        raise e.error from None
    finally:
        stream.close()
    members = message.get("members", ())
    if not isinstance(members, list) or not all(
        isinstance(m, int) and not isinstance(m, bool) for m in members
    ):
        raise errors.InvalidArgumentError(f"{who}: bad members {members!r}")
    return View(_int(message, "generation"), tuple(members), _extended(message, ()))


def _extended(message: dict[str, Any], addresses: tuple[str, ...]) -> tuple[str, ...]:
    """The group's address table from ``message``, then ``addresses`` beyond its end."""
    table = message.get("addresses") or []
    if not isinstance(table, list) or not all(isinstance(a, str) for a in table):
        raise errors.InvalidArgumentError(f"re-form message: bad address table {table!r}")
    return (*table, *addresses[len(table) :])


def decision_message(decision: Decision) -> dict[str, Any]:
    """The JSON form of a decision (what the leader sends each joiner)."""
    return {
        "generation": decision.view.generation,
        "members": list(decision.view.members),
        "addresses": list(decision.view.addresses),
        "resume": decision.resume.as_dict(),
        "source": decision.source,
        "initial_workers": decision.initial_workers,
    }


def ask_to_join(door: Door, view: View, me: int, wait: float) -> Decision:
    """Asks ``view``'s rank 0 to admit this worker at its next step boundary; its decision.

    Raises:
        StaleGenerationError: the group changed meanwhile (read its view again).
        UnavailableError / DeadlineExceededError: rank 0 is gone, or did not admit in time.
    """
    leader = view.members[0]
    who = f"worker:{leader} at {view.addresses[leader]}"
    client = f"admit:{me}/gen:{view.generation}"
    stream = _dial(door.security, view.addresses[leader], client, time.monotonic() + 2.0, who)
    try:
        send_json(stream, {"address": view.addresses[me]})
        try:
            message = read_json(stream, time.monotonic() + wait, who)
        except RemoteError as refused:
            if isinstance(refused.error, errors.AbortedError):
                raise StaleGenerationError(str(refused.error)) from None
            raise refused.error from None
    finally:
        stream.close()
    decision = _decision(message, view.addresses, who)
    if me not in decision.view.members:
        raise errors.InvalidArgumentError(f"{who} sent a malformed admission: {message!r}")
    return decision
