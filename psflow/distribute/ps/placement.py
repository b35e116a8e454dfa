"""Which parameter-server task holds each variable: the placement map, and how it changes.

A :class:`PlacementMap` is versioned: every resize of the parameter servers
makes a new map with a higher version.  Sessions route each pull and push by
their map; a task asked for a variable it gave away answers with
``MovedError`` naming the new owner, and the session updates its map and
resends.  :func:`plan_resize` decides which variables move when the number of
tasks changes: the fewest moves that leave the tasks balanced by bytes.

Example:
    >>> m = PlacementMap(0, {"a": 0, "b": 1, "c": 0, "d": 1}, ("h:1", "h:2"))
    >>> [(mv.key, mv.source, mv.target) for mv in plan_resize(m, 3, dict.fromkeys("abcd", 4))]
    [('a', 0, 2)]
    >>> [(mv.key, mv.source, mv.target) for mv in plan_resize(m, 1, dict.fromkeys("abcd", 4))]
    [('b', 1, 0), ('d', 1, 0)]
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

from psflow import errors

__all__ = ["Move", "PlacementMap", "ResizeReport", "plan_resize"]


@dataclasses.dataclass(frozen=True)
class PlacementMap:
    """Owners of variables, and the addresses of the tasks, at one version.

    Args:
        version: grows with every resize (0: the layout variables were created with).
        owners: variable key -> task index in job ``ps``.
        addresses: ``host:port`` of tasks ``0..num_tasks-1``.
    """

    version: int
    owners: Mapping[str, int]
    addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        # read-only, so a map shared between threads and closures never changes under them
        object.__setattr__(self, "owners", types.MappingProxyType(dict(self.owners)))
        object.__setattr__(self, "addresses", tuple(self.addresses))

    def __reduce__(self) -> tuple:
        return (PlacementMap, (self.version, dict(self.owners), self.addresses))

    @property
    def num_tasks(self) -> int:
        """Parameter-server tasks in this layout."""
        return len(self.addresses)

    def owner(self, key: str) -> int:
        """The task holding ``key``.

        Raises:
            NotFoundError: ``key`` is not placed (quoted).
        """
        try:
            return self.owners[key]
        except KeyError:
            raise errors.NotFoundError(
                f"variable {key!r} has no owner in the placement map"
            ) from None

    def keys_of(self, task: int) -> list[str]:
        """The keys task ``task`` holds, sorted."""
        return sorted(k for k, t in self.owners.items() if t == task)

    def with_owners(
        self,
        owners: Mapping[str, int],
        *,
        version: int | None = None,
        addresses: tuple[str, ...] | None = None,
    ) -> PlacementMap:
        """A copy with ``owners`` updated (and the version and addresses, if given)."""
        return PlacementMap(
            self.version if version is None else version,
            {**self.owners, **owners},
            self.addresses if addresses is None else addresses,
        )


@dataclasses.dataclass(frozen=True)
class Move:
    """One variable changing owner."""

    key: str
    source: int
    target: int


def plan_resize(
    placement: PlacementMap,
    num_tasks: int,
    sizes: Mapping[str, int],
    *,
    first_added: int | None = None,
) -> list[Move]:
    """The moves that take ``placement`` to ``num_tasks`` tasks, balanced by bytes.

    Every key of a task ``>= num_tasks`` moves (largest first, to the least
    loaded remaining task); when tasks are added, keys move from the most
    loaded tasks to the new ones only while that narrows the gap between them.
    Nothing else moves.  Deterministic: ties go to the lower task index and
    the smaller key.

    Args:
        placement: the current map.
        num_tasks: tasks after the resize (>= 1).
        sizes: bytes of each key (keys missing count as 1 byte).
        first_added: the first task that counts as added (default: the map's
            task count; a resize resumed after a failure passes the count it
            started from, since the map already lists the tasks it added).

    Raises:
        InvalidArgumentError: ``num_tasks < 1``.
    """
    if num_tasks < 1:
        raise errors.InvalidArgumentError(f"cannot resize to {num_tasks} parameter servers")
    owners = dict(placement.owners)
    size = {k: max(int(sizes.get(k, 1)), 1) for k in owners}
    load = [0] * num_tasks
    for k, t in owners.items():
        if t < num_tasks:
            load[t] += size[k]
    moves: list[Move] = []
    # phase 1: everything on a removed task goes to the least loaded remaining one
    leaving = sorted((k for k, t in owners.items() if t >= num_tasks), key=lambda k: (-size[k], k))
    for k in leaving:
        target = min(range(num_tasks), key=lambda t: (load[t], t))
        moves.append(Move(k, owners[k], target))
        owners[k] = target
        load[target] += size[k]
    # phase 2: new tasks take their share from the most loaded ones
    new_tasks = range(placement.num_tasks if first_added is None else first_added, num_tasks)
    if not new_tasks:
        return moves
    for _ in range(len(owners)):
        target = min(new_tasks, key=lambda t: (load[t], t))
        source = max(range(num_tasks), key=lambda t: (load[t], -t))
        gap = load[source] - load[target]
        candidates = [k for k, t in owners.items() if t == source and size[k] < gap]
        if not candidates:
            break
        # the key that leaves the two closest to even
        k = min(candidates, key=lambda k: (abs(gap - 2 * size[k]), k))
        moves.append(Move(k, source, target))
        owners[k] = target
        load[source] -= size[k]
        load[target] += size[k]
    return moves


@dataclasses.dataclass(frozen=True)
class ResizeReport:
    """What a resize of the parameter servers did.

    Attributes:
        old_num_ps, new_num_ps: tasks before and after.
        version_before, version_after: placement-map versions.
        bytes_moved: bytes of the moved variables' state (values, slots, records).
        shards_moved: variables (or shards of partitioned ones) that changed owner.
        seconds: wall time of the whole resize.
        longest_fence_seconds: the longest any one variable could not be served
            (from its export to its release at the old owner).
    """

    old_num_ps: int
    new_num_ps: int
    version_before: int
    version_after: int
    bytes_moved: int
    shards_moved: int
    seconds: float
    longest_fence_seconds: float
