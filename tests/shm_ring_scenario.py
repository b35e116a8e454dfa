"""One worker of a same-host ring, for ``tests/test_shm_ring.py``.

``python shm_ring_scenario.py MODE OUT`` with ``RING_ADDRESSES`` (every worker's
``host:port``), ``RING_RANK``, ``RING_TOKEN`` and ``RING_TIMEOUT`` set: connects the
ring's links, runs MODE through ``CrossHostRing`` and writes ``OUT.json`` (and, for
``sums``, the inputs and results to ``OUT.npz``).  ``SHM_RING_MIN`` / ``SHM_RING_CAP``
set the slots' smallest and largest sizes, so that small arrays grow the segments
and go in pieces; ``SHM_RING_SMALL`` the size under which a buffer takes the TCP ring;
``SHM_RING_DIR`` another directory for this worker's segments (a ``/dev/shm`` the
others do not see, as a worker in another container on the host's network has).
``PSFLOW_HOST_ID`` makes "hosts" of loopback workers (``tests/test_shm_hier.py``);
``HIER_DEAF=1`` gives this worker's host-group and rail rings ports that accept nobody.

Modes:
    sums: every dtype, packs, several arrays straight into the slots, a mean, empty and
        odd sizes, calls larger than the cap.
    kill: all-reduces until ``KILL_RANK`` sends itself ``KILL_SIGNAL`` in the middle of
        one (its arrays staged, before the first barrier's frame; with ``KILL_IN=rail``,
        its chunk summed, before its all-reduce across the hosts); the others report
        the error they get.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time

import numpy as np

import psflow as pf
from psflow.collective import peer_link, shm_ring
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.peer_link import PeerLinks
from psflow.security.config import SecurityConfig
from psflow.transport import shm

# (dtype, size) of the sums mode's calls: odd sizes, fewer elements than workers, empty
DTYPES = ("float32", "float64", "float16", "int32", "int64", "uint8", "complex64")
SIZES = (0, 1, 2, 7, 1001, 40_003)


def _seeded(rank: int, dtype: str, size: int, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + 17 * size + salt)
    kind = np.dtype(dtype).kind
    if kind in "iu":
        return rng.integers(0, 50, size).astype(dtype)
    x = rng.standard_normal(size)
    if kind == "c":
        x = x + 1j * rng.standard_normal(size)
    return x.astype(dtype)


def sums(ring: CrossHostRing, rank: int) -> tuple[dict, dict[str, np.ndarray]]:
    arrays: dict[str, np.ndarray] = {}
    leftover = None
    for dtype in DTYPES:
        for size in SIZES:
            x = _seeded(rank, dtype, size)
            arrays[f"in/{dtype}/{size}"] = x
            arrays[f"sum/{dtype}/{size}"] = ring.all_reduce([x])[0]
            if leftover is None:  # agreed by the first call: every name is unlinked by now
                prefix = f"psflow-{os.getpid()}-"
                leftover = [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]
    # several arrays of two dtypes in one call, in packs of 1000 bytes and whole
    mixed = [_seeded(rank, d, n, 1) for d, n in (("float32", 3001), ("int64", 5), ("float32", 9))]
    for i, x in enumerate(mixed):
        arrays[f"in/mixed/{i}"] = x
    for pack in (0, 1000):
        for i, y in enumerate(ring.all_reduce(mixed, bytes_per_pack=pack)):
            arrays[f"sum/mixed/{pack}/{i}"] = y
    # several arrays over the small-buffer size: written straight into the slots, a piece
    # spanning several arrays and an array several pieces; whole, and in packs of 150 kB
    # (the last one short of it); the same bits as their concatenation in one array
    sizes = (30_001, 7, 20_000, 3, 9_000, 1)
    spread = [_seeded(rank, "float32", k, 4) for k in sizes] + [_seeded(rank, "float64", 5, 4)]
    for i, x in enumerate(spread):
        arrays[f"in/spread/{i}"] = x
    same = []
    for pack in (0, 150_000):
        got = ring.all_reduce(spread, bytes_per_pack=pack)
        for i, y in enumerate(got):
            arrays[f"sum/spread/{pack}/{i}"] = y
        whole = ring.all_reduce([np.concatenate(spread[:-1])], bytes_per_pack=pack)[0]
        same.append(bool(np.array_equal(np.concatenate(got[:-1]), whole)))
    # a mean of floats (divided once, by each chunk's owner)
    x = _seeded(rank, "float32", 70_001, 2)
    arrays["in/mean"] = x
    arrays["mean"] = ring.all_reduce([x], divisor=ring.size)[0]
    # a call of many slots at the cap (and the segments' growth before it)
    x = _seeded(rank, "float32", 600_007, 3)
    arrays["in/large"] = x
    arrays["sum/large"] = ring.all_reduce([x])[0]
    segments = ring.hier.host if ring.hier.active else ring.shm
    meta = {
        "active": ring.shm.active,
        "reason": ring.shm.reason,
        "hier": ring.hier.active,
        "hier_reason": ring.hier.reason,
        "groups": ring.hier.groups,
        "slot_bytes": segments._set.slot_bytes if segments._set is not None else None,
        "leftover": leftover,
        "spread_same_bits": same,
    }
    return meta, arrays


def kill(ring: CrossHostRing, rank: int) -> dict:
    victim = int(os.environ["KILL_RANK"])
    fault = getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL"))
    barrier = shm_ring.SharedMemoryRing._barrier
    calls = [0]

    def barrier_then_die(self, *args, **kwargs):  # the victim dies with its arrays staged
        calls[0] += 1
        if rank == victim and calls[0] == 7:
            os.kill(os.getpid(), fault)
        return barrier(self, *args, **kwargs)

    def rail_then_die(self, *args, **kwargs):  # the victim dies with its chunk summed
        calls[0] += 1
        if rank == victim and calls[0] == 4:
            os.kill(os.getpid(), fault)
        return ring_reduce(self, *args, **kwargs)

    if os.environ.get("KILL_IN") == "rail":  # the flat ring's is not used: 400 kB a call
        ring_reduce = CrossHostRing._ring_reduce
        CrossHostRing._ring_reduce = rail_then_die
    else:
        shm_ring.SharedMemoryRing._barrier = barrier_then_die
    x = np.ones(100_000, np.float32)
    for _ in range(1000):
        ring.all_reduce([x])
        time.sleep(0.01)
    return {"calls": calls[0]}


def _deaf(address: str, security: SecurityConfig, who: str) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def main() -> int:
    mode, out = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if "SHM_RING_MIN" in os.environ:
        shm_ring._MIN_SLOT_BYTES = int(os.environ["SHM_RING_MIN"])
    if "SHM_RING_CAP" in os.environ:
        shm_ring._MAX_SLOT_BYTES = int(os.environ["SHM_RING_CAP"])
    if "SHM_RING_DIR" in os.environ:  # a /dev/shm of its own, as in another container
        shm.SHM_DIR = os.environ["SHM_RING_DIR"]
    if "SHM_RING_SMALL" in os.environ:
        shm_ring._SMALL_BYTES = int(os.environ["SHM_RING_SMALL"])
    addresses = os.environ["RING_ADDRESSES"].split(",")
    rank = int(os.environ["RING_RANK"])
    timeout = float(os.environ.get("RING_TIMEOUT", "20"))
    links = PeerLinks(rank, addresses, SecurityConfig(token=os.environ["RING_TOKEN"]))
    ring = CrossHostRing(links, timeout)
    started = time.monotonic()
    result: dict = {"pid": os.getpid()}
    try:
        links.connect(timeout)
        started = time.monotonic()
        if os.environ.get("HIER_DEAF") == "1":  # bound, not listening: dials are refused
            peer_link.listen = _deaf
        if mode == "sums":
            meta, arrays = sums(ring, rank)
            result.update(meta)
            np.savez(out + ".npz", **arrays)
        else:
            result.update(kill(ring, rank))
    except pf.errors.OpError as e:
        result.update(error=type(e).__name__, message=str(e), seconds=time.monotonic() - started)
    finally:
        ring.close()
    with open(out + ".json", "w") as f:
        json.dump(result, f)
    return 3 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
