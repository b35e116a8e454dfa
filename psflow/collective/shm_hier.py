"""The workers' all-reduce when several of them share each of several hosts.

NCCL's hierarchy, for a ring of ``G`` hosts with ``L`` workers each: the bytes
are summed inside each host through shared memory, only what must cross goes
over TCP, and each host gathers the result through shared memory again.  One
piece of a call (a slot of :class:`~psflow.collective.shm_ring.SharedMemoryRing`,
split into ``L`` chunks, chunk ``c`` owned by the host's member ``c``):

1. **stage** into the host's segments; *group barrier*;
2. **sum**: each owner adds its chunk over the ``L`` members (no division);
3. **across**: it all-reduces that sum over its *rail*, the ring of the ``G``
   workers of its local index, one per host (the TCP ring's reduce-scatter and
   all-gather, :meth:`~psflow.collective.cross_host.CrossHostRing._ring_reduce`:
   a mean is divided there, once), and writes the result into its slot;
   *group barrier*;
4. **gather**: every member copies the other chunks from their owners' slots.

Each chunk's value comes from one rail's ring, which gives its members equal
bits, and is then copied: every worker ends with the same bits.  Each worker
sends ``2(G-1)/G`` of its chunk (``S/L``) over TCP, where the flat ring sends
``2(N-1)/N`` of ``S``.  Buffers under 128 kB stay on the flat TCP ring.

**Hosts.** At the first all-reduce every worker all-gathers a hash of its host
key over the ring: the boot id, the network namespace's inode and ``/dev/shm``'s
device (or ``PSFLOW_HOST_ID``, as NCCL's ``NCCL_HOSTID``; where a part cannot be
read the key is the process's own: no grouping).  Workers of one key form a
group; groups are ordered by their lowest rank, members by rank.

**When.**  ``G >= 2`` groups of one size ``L >= 2``; on every worker shared
memory allowed and both new rings connected; and every member able to open
its group's segments (the same exchange as the one-host path, restricted to the
group).  Every worker learns every outcome (all-gathers), so all decide the same.
Otherwise the one-host rules apply unchanged (every worker on loopback: shared
memory; else the flat TCP ring), with one log line saying why the hierarchy is
off where ``G >= 2`` and some group has several members.  An elastic ring
(its links come through a :class:`~psflow.collective.door.Door`, its members
change at every re-form) keeps the one-host rules, and says so in one log line.

**Links.** The group ring (for the barriers) and the rail ring are plain
:class:`~psflow.collective.peer_link.PeerLinks`, made once at the agreement:
each on a new port of this worker's own address (its ports all-gathered over
the ring; both connect at once, by half of what the first call has left), the
same token or TLS, deadlines and heartbeats, errors naming the workers' global
ids.  While one link set is in use the others lie unread (their heartbeats queue
up), so a neighbour's silence counts from when this worker reads its link again.
A failure on any of the three link sets is forwarded to the other two, so a
worker killed or frozen mid-call gives every survivor, in its host and in the
others, the typed error naming it (the rail tells the groups, the groups tell
the rails).  :meth:`HostHierarchy.close` closes them.

Example (a single worker has no peers: nothing is agreed, the flat path is used):
    >>> HostHierarchy(None, SharedMemoryRing(None), 5.0, lambda *a: None).active is None
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from psflow import errors, settings
from psflow.collective import peer_link
from psflow.collective.shm_ring import Packed, SharedMemoryRing, _text, by_size
from psflow.transport import shm

__all__ = ["HostHierarchy", "host_key"]

log = logging.getLogger(__name__)

# One agreement record: the host key's hash; then each worker's two ports (0: none) and why
# not; then whether both of its rings came up, and why not.
_KEY = struct.Struct("<32s")
_PORTS = struct.Struct("<HH160s")
_UP = struct.Struct("<B7x160s")
_PROCESS_KEY = f"process:{uuid.uuid4().hex}"  # a host key unique to this process


def host_key() -> str:
    """This worker's host, as the hierarchy groups workers: ``PSFLOW_HOST_ID`` if set, else
    the boot id, network namespace and ``/dev/shm`` device (unique to this process where
    any of them cannot be read: macOS, Windows)."""
    override = settings.current().host_id
    if override:
        return f"id:{override}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        net = os.stat("/proc/self/ns/net").st_ino
        dev = os.stat(shm.SHM_DIR).st_dev
    except OSError:
        return _PROCESS_KEY
    return f"{boot}/{net}/{dev}"


def _groups(keys: list[bytes]) -> list[list[int]]:
    """The ranks of each key, groups in the order of their lowest rank, members by rank."""
    found: dict[bytes, list[int]] = {}
    for rank, key in enumerate(keys):
        found.setdefault(key, []).append(rank)
    return list(found.values())


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class HostHierarchy:
    """A :class:`~psflow.collective.cross_host.CrossHostRing`'s all-reduce path: the
    hierarchy where its agreement turns it on, else ``flat`` (the one-host shared-memory
    path, or the TCP ring).

    Used by the ring's ``all_reduce`` only, under its lock, inside its calls.

    Args:
        links: the ring's connected links (None: a single worker).
        flat: the ring's one-host path, used (and agreed) when the hierarchy is off.
        timeout: the ring's timeout (the new links' silence; their connect's bound).
        make_ring: ``make_ring(links, timeout)``: a ring of the same kind over the rail's
            links, whose ``_ring_reduce`` all-reduces each owner's chunk across the hosts.
    """

    def __init__(
        self,
        links: Any,
        flat: SharedMemoryRing,
        timeout: float,
        make_ring: Callable[[Any, float], Any],
    ) -> None:
        self.links = links
        self.flat = flat
        self.timeout = timeout
        self._make_ring = make_ring
        #: None until the first all-reduce agreed; then whether the hierarchy is on
        self.active: bool | None = None
        #: why it is off where several hosts have several workers (else None)
        self.reason: str | None = None
        #: the workers' ranks by host (after the agreement; None on an elastic ring)
        self.groups: list[list[int]] | None = None
        self.host: SharedMemoryRing | None = None  # this host's segments; group-ring barriers
        self.group_links: peer_link.PeerLinks | None = None
        self.rail: Any = None  # the ring of this worker's local index across the hosts
        self._reduce: Callable[..., None] | None = None

    # -- agreement --------------------------------------------------------------------------
    def reducer(self, deadline: float, fallback: Callable[..., None]) -> Callable[..., None]:
        """What all-reduces one buffer in this call (see ``SharedMemoryRing.reducer``); the
        first call agrees on the path.

        Raises:
            UnavailableError / DeadlineExceededError: a peer failed during the agreement.
        """
        if self.active is None and self.links is not None:
            self._agree(deadline)
        if self.active:
            self._reduce = self._reduce or by_size(self.reduce, fallback)
            return self._reduce
        return self.flat.reducer(deadline, fallback)  # off, or a single worker

    def packs(self, nbytes: int, dtype: np.dtype, bytes_per_pack: int) -> bool:
        """Whether a call of several arrays should come as a :class:`Packed`."""
        if self.active and self.host is not None:
            return self.host.packs(nbytes, dtype, bytes_per_pack)
        return self.flat.packs(nbytes, dtype, bytes_per_pack)

    def _agree(self, deadline: float) -> None:
        """Every worker decides the same: the hierarchy on (links up, segments mapped) or off."""
        links = self.links
        if links.elastic:  # its members change at every re-form: no host groups to keep
            self.active = False
            log.info(
                "collective: an elastic ring's all-reduces take no host hierarchy (shared "
                "memory only when every worker is on this host, else the TCP ring)"
            )
            return
        digest = hashlib.sha256(host_key().encode()).digest()
        groups = _groups(self.flat.all_gather(_KEY.pack(digest), deadline))
        self.groups = groups
        sizes = sorted({len(g) for g in groups})
        if len(groups) < 2 or sizes[-1] < 2:
            self.active = False  # one host, or one worker a host: the one-host rules
            return
        try:
            why = None
            if len(sizes) > 1:
                why = f"the hosts have different numbers of workers ({[len(g) for g in groups]})"
            else:
                why = self._connect(groups, deadline)
                if why is None:
                    self.host = SharedMemoryRing(
                        links, members=self._group(groups), barrier_links=self.group_links
                    )
                    why = self.host.join(deadline)
        except BaseException:
            self.close()
            raise
        n, g = links.size, len(groups)
        if why is None:
            self.active = True
            log.info(
                "collective: the %d workers' all-reduces go through shared memory on each of "
                "%d hosts (%d workers each), and TCP across them",
                n,
                g,
                sizes[0],
            )
            return
        self.close()
        self.active = False
        self.reason = why
        log.info(
            "collective: no host hierarchy for the all-reduces of %d workers on %d hosts: %s",
            n,
            g,
            why,
        )

    def _group(self, groups: list[list[int]]) -> list[int]:
        return next(g for g in groups if self.links.rank in g)

    def _connect(self, groups: list[list[int]], deadline: float) -> str | None:
        """Connects the group ring and the rail ring; None when every worker's came up.

        Every worker takes part in both rounds whatever happens to it, so all learn
        every outcome; where one failed, every ring that came up is closed again.
        """
        links = self.links
        r = links.rank
        group = self._group(groups)
        local = group.index(r)
        rail = [g[local] for g in groups]
        host = peer_link.split_address(links.addresses[r])[0]
        why: str | None = shm.sharing_unavailable_reason()  # then no ring is worth its ports
        listeners = []
        if why is None:
            try:
                for _ in range(2):
                    listeners.append(
                        peer_link.listen(
                            _address(host, 0), links.security, f"worker:{links.ids[r]}"
                        )
                    )
            except errors.OpError as e:
                why = str(e)
        ports = [s.getsockname()[1] for s in listeners] if why is None else [0, 0]
        record = _PORTS.pack(*ports, (why or "").encode()[:160])
        got = [_PORTS.unpack(raw) for raw in self.flat.all_gather(record, deadline)]
        for k, (group_port, _, text) in enumerate(got):
            if not group_port:
                why = why or f"off on worker:{links.ids[k]} ({_text(text)})"
        if why is not None:
            for s in listeners:
                s.close()
            return why
        made: list[peer_link.PeerLinks] = []
        try:
            for members, which, sock in ((group, 0, listeners[0]), (rail, 1, listeners[1])):
                addresses = [
                    _address(peer_link.split_address(links.addresses[k])[0], got[k][which])
                    for k in members
                ]
                made.append(
                    peer_link.PeerLinks(
                        members.index(r),
                        addresses,
                        links.security,
                        listener=sock,
                        silence_seconds=self.timeout,
                        generation=links.generation,
                        ids=[links.ids[k] for k in members],
                    )
                )
            # both at once, by half of what the call has left: a peer that never answers
            # leaves the other half to the rounds below and the call itself
            limit = max(0.001, min(self.timeout, (deadline - time.monotonic()) / 2))
            failed: list[BaseException | None] = [None, None]

            def connect(i: int) -> None:
                try:
                    made[i].connect(limit)
                except BaseException as e:
                    failed[i] = e

            helper = threading.Thread(target=connect, args=(0,), name="psflow-hier-connect")
            helper.start()
            connect(1)
            helper.join()
            for e in failed:
                if isinstance(e, errors.OpError):
                    why = why or f"a ring between the hosts did not connect: {e}"
                elif e is not None:
                    raise e
            # the ring's frames waited unread meanwhile (up to a timeout: a silent peer's
            # dial): judge the left neighbour's silence from now, not from the call's start
            links.begin()
            flag = _UP.pack(why is None, (why or "").encode()[:160])
            for k, raw in enumerate(self.flat.all_gather(flag, deadline)):
                ok, text = _UP.unpack(raw)
                if not ok:
                    why = why or f"off on worker:{links.ids[k]} ({_text(text)})"
        except BaseException:
            for ring in made:
                ring.close()
            for s in listeners:
                s.close()
            raise
        if why is not None:
            for ring in made:
                ring.close()
            return why
        self.group_links = made[0]
        self.rail = self._make_ring(made[1], self.timeout)
        return None

    # -- the all-reduce -------------------------------------------------------------------
    def reduce(
        self, src: np.ndarray | Packed, dst: np.ndarray, divisor: int | None, deadline: float
    ) -> None:
        """All-reduces ``src`` into ``dst``: shared memory in the host, TCP across the hosts.

        Raises:
            UnavailableError / DeadlineExceededError: a peer failed (named), on every
                worker: a failure is forwarded over every link set.
            InternalError: the workers called different collectives.
            CancelledError: the ring was closed.
        """
        host, group, rail = self.host, self.group_links, self.rail
        if host is None or group is None or rail is None:
            self.links.check()
            raise errors.CancelledError("collective: the ring was closed")

        def across(chunk: np.ndarray, out: np.ndarray) -> None:
            # each link set lies unread while the other is in use (its heartbeats queue up):
            # a neighbour's silence counts from when this worker reads it again
            rail.links.begin()
            sending: list = []
            rail._ring_reduce(chunk, out, divisor, deadline, sending)
            for done in sending:  # the chunk is sent from its slot: it leaves before the copy
                rail.links.wait_sent(done, deadline)
            np.copyto(chunk, out)  # what the group gathers
            group.begin()

        group.begin()
        rail.links.begin()
        try:
            host.reduce(src, dst, None, deadline, across)
            self.links.begin()  # the ring lay unread meanwhile: a later buffer may take it
        except errors.OpError as e:
            # one link set saw it: the others' peers may be waiting on this worker there
            for other in (group, rail.links, self.links):
                with contextlib.suppress(errors.OpError):
                    other.fail(e)
            raise
        finally:
            group.end()
            rail.links.end()

    def close(self) -> None:
        """Closes the group and rail rings and unmaps the host's segments (idempotent)."""
        if self.group_links is not None:
            self.group_links.close()
        if self.rail is not None:
            self.rail.close()
        if self.host is not None:
            self.host.close()  # after the links: a call still under way fails first
