"""The workers' same-host all-reduce through shared memory (psflow/collective/shm_ring.py).

Real worker processes on 127.0.0.1 (``tests/shm_ring_scenario.py``: real links, token
auth, every process bounded and reaped), their results compared with NumPy and with
each other; faults are real signals sent by a worker to itself in the middle of a call.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow.collective import shm_ring
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.peer_link import PeerLinks
from psflow.security.config import SecurityConfig
from psflow.transport import shm
from tests.conftest import ROOT, pick_free_port
from tests.multi_worker_util import (
    LOST_PEER_FAULTS,
    assert_survivors_name_the_lost_peer,
    ring_links,
    run_processes,
)
from tests.shm_ring_scenario import DTYPES, SIZES

SCENARIO = ROOT / "tests" / "shm_ring_scenario.py"
TOKEN = "shm-ring-test-token-0123456789"

pytestmark = pytest.mark.skipif(
    shm.sharing_unavailable_reason() is not None, reason="no shared memory on this platform"
)


def _run(
    tmp: pathlib.Path,
    mode: str,
    n: int,
    env: dict[str, str] | None = None,
    per_rank: dict[int, dict[str, str]] | None = None,
    wait_for: set[int] | None = None,
    timeout: float = 60.0,
) -> tuple[list[int | None], list[dict], list[str], list[int]]:
    """Runs ``n`` workers of MODE; (exit codes, JSON results, logs, pids), all reaped.

    Only the ranks in ``wait_for`` (default: all) are waited for; the others are killed
    once those exited (code None).
    """
    addresses = ",".join(f"127.0.0.1:{pick_free_port()}" for _ in range(n))
    envs = [
        {
            "RING_ADDRESSES": addresses,
            "RING_RANK": str(rank),
            "RING_TOKEN": TOKEN,
            **(env or {}),
            **(per_rank or {}).get(rank, {}),
        }
        for rank in range(n)
    ]
    logs = [tmp / f"{mode}-{rank}.log" for rank in range(n)]
    argvs = [[sys.executable, str(SCENARIO), mode, str(tmp / f"{mode}-{r}")] for r in range(n)]
    codes, pids = run_processes(argvs, envs, logs, timeout=timeout, wait_for=wait_for)
    results = []
    for rank in range(n):
        path = tmp / f"{mode}-{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return codes, results, [lg.read_text(errors="replace") for lg in logs], pids


def _leftovers(pids: list[int]) -> list[str]:
    """Segments in /dev/shm of any of these processes."""
    prefixes = tuple(f"psflow-{pid}-" for pid in pids)
    return [f for f in os.listdir(shm.SHM_DIR) if f.startswith(prefixes)]


def _check_sums(tmp: pathlib.Path, n: int) -> None:
    """Every worker's results: the same bits, and NumPy's sum of the inputs (in float64)."""
    data = [np.load(tmp / f"sums-{rank}.npz") for rank in range(n)]
    keys = [k for k in data[0].files if not k.startswith("in/")]
    assert len(keys) == len(DTYPES) * len(SIZES) + 8 + 14

    def inputs(key: str) -> list[np.ndarray]:
        if key.startswith("sum/mixed/"):
            key = "in/mixed/" + key.rsplit("/", 1)[1]
        elif key.startswith("sum/spread/"):
            key = "in/spread/" + key.rsplit("/", 1)[1]
        elif key == "mean":
            key = "in/mean"
        else:
            key = "in/" + key.split("/", 1)[1]
        return [d[key] for d in data]

    for key in keys:
        got = [d[key] for d in data]
        xs = inputs(key)
        assert all(g.dtype == xs[0].dtype and g.shape == xs[0].shape for g in got), key
        assert all(np.array_equal(g, got[0]) for g in got[1:]), key  # identical bits
        exact = np.sum([x.astype(np.complex128) for x in xs], axis=0)
        if key == "mean":
            exact = exact / n
        kind = xs[0].dtype.kind
        if kind in "iu":  # integers: exact (uint8 wraps, as NumPy's own sum does)
            assert np.array_equal(got[0], exact.real.astype(np.int64).astype(xs[0].dtype)), key
            continue
        # N-1 additions (and a division) each off by half an ulp of a partial sum at most
        eps = float(np.finfo(xs[0].dtype).eps)
        bound = eps * (n + 1) * np.sum([np.abs(x.astype(np.complex128)) for x in xs], axis=0)
        err = np.abs(got[0].astype(np.complex128) - exact)
        assert np.all(err <= bound + 1e-30), (key, float(np.max(err - bound)))
    if n == 2:  # two workers: one addition per element, as NumPy's x0 + x1 exactly
        for key in keys:
            if key.startswith("sum/float32/"):
                xs = inputs(key)
                assert np.array_equal(data[0][key], xs[0] + xs[1]), key
        assert np.array_equal(data[0]["mean"], (inputs("mean")[0] + inputs("mean")[1]) / 2)


@pytest.mark.parametrize(("n", "small"), [(2, 0), (3, 0), (2, None)])
def test_workers_sum_every_dtype_pack_and_size_to_the_same_bits_through_shared_memory(
    tmp_path, n, small
):
    # slots of 16 kB growing to 64 kB: the small calls grow the segments (agreed again),
    # the 2.4 MB one goes in 38 pieces, alternating the slots.  Every buffer through
    # shared memory (small=0), or (by default) those under 128 kB on the TCP ring between
    env = {"SHM_RING_MIN": str(16 << 10), "SHM_RING_CAP": str(64 << 10)}
    if small is not None:
        env["SHM_RING_SMALL"] = str(small)
    codes, results, logs, pids = _run(tmp_path, "sums", n, env)
    assert codes == [0] * n, "\n---\n".join(lg[-3000:] for lg in logs)
    for r in results:
        assert r["active"] is True and r["reason"] is None, r
        assert r["slot_bytes"] == 64 << 10
        assert r["leftover"] == []  # every name unlinked once every peer had mapped it
        assert r["spread_same_bits"] == [True, True]  # arrays straight in == one buffer
    _check_sums(tmp_path, n)
    assert _leftovers(pids) == []
    for log in logs:
        assert "stay on TCP" not in log


@pytest.mark.parametrize("off", [0, 1])
def test_shared_memory_off_on_one_worker_keeps_every_worker_on_tcp(tmp_path, off):
    codes, results, logs, pids = _run(tmp_path, "sums", 2, per_rank={off: {"PSFLOW_SHM": "0"}})
    assert codes == [0, 0], "\n---\n".join(lg[-3000:] for lg in logs)
    assert [r["active"] for r in results] == [False, False]
    assert "PSFLOW_SHM=0" in results[off]["reason"]
    other = results[1 - off]["reason"]
    assert f"off on worker:{off}" in other and "PSFLOW_SHM=0" in other
    for log in logs:  # one line each, saying why
        assert log.count("stay on TCP") == 1, log
    _check_sums(tmp_path, 2)  # the TCP ring's results, as exact
    assert _leftovers(pids) == []


def test_workers_that_do_not_share_dev_shm_agree_on_tcp(tmp_path):
    # loopback addresses but separate /dev/shm (containers on the host's network): each
    # worker made its segment, neither finds the other's, so both stay on TCP
    own = tmp_path / "shm"
    own.mkdir()
    codes, results, logs, pids = _run(tmp_path, "sums", 2, per_rank={1: {"SHM_RING_DIR": str(own)}})
    assert codes == [0, 0], "\n---\n".join(lg[-3000:] for lg in logs)
    assert [r["active"] for r in results] == [False, False]
    assert "worker:1's segment cannot be used here" in results[0]["reason"]
    assert "worker:0's segment cannot be used here" in results[1]["reason"]
    assert list(own.iterdir()) == []  # worker 1's segment unlinked all the same
    for log in logs:  # one line each, saying why
        assert log.count("stay on TCP") == 1, log
    _check_sums(tmp_path, 2)  # the TCP ring's results, as exact
    assert _leftovers(pids) == []


@pytest.mark.parametrize(("fault", "errors_allowed"), LOST_PEER_FAULTS)
def test_a_worker_lost_mid_call_gives_every_survivor_a_typed_error_naming_it(
    tmp_path, fault, errors_allowed
):
    timeout = 2.0
    codes, results, logs, pids = _run(
        tmp_path,
        "kill",
        3,
        env={"KILL_RANK": "1", "KILL_SIGNAL": fault, "RING_TIMEOUT": str(timeout)},
        wait_for={0, 2},
        timeout=40,
    )
    assert_survivors_name_the_lost_peer(codes, results, logs, errors_allowed, 2 * timeout + 3)
    # the victim died with its segment mapped by everyone: nothing of it (or of the
    # survivors, closed since) is left in /dev/shm
    assert _leftovers(pids) == []


def _links_to(addresses: list[str]) -> PeerLinks:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    addresses = [f"127.0.0.1:{listener.getsockname()[1]}", *addresses]
    return PeerLinks(0, addresses, SecurityConfig(token="t" * 24), listener=listener)


def test_a_peer_off_this_host_keeps_the_ring_on_tcp_naming_it():
    links = _links_to(["10.1.2.3:5000"])
    try:
        why = shm_ring.SharedMemoryRing(links)._local_reason()
    finally:
        links.close()
    assert why == "worker:1 at 10.1.2.3:5000 is not on this host's loopback"


def test_a_peer_segment_without_its_token_or_through_a_link_is_refused(tmp_path):
    links = _links_to(["127.0.0.1:1"])
    ring = shm_ring.SharedMemoryRing(links)
    name = f"{shm.new_prefix()}-ring9-1"
    seg = shm.Segment(name, shm_ring._HEADER_BYTES + 2 * 4096, create=True)
    link = f"{shm.new_prefix()}-ring9-2"
    try:
        token = os.urandom(16)
        head = shm_ring._MAGIC + token + (4096).to_bytes(8, "little")
        seg.view()[: len(head)] = head
        ring._open(name, token, 4096, 4096).close()  # the real one opens
        with pytest.raises(pf.errors.PermissionDeniedError, match="token"):
            ring._open(name, os.urandom(16), 4096, 4096)
        os.symlink(os.path.join(shm.SHM_DIR, name), os.path.join(shm.SHM_DIR, link))
        with pytest.raises(pf.errors.InvalidArgumentError, match="cannot be used"):
            ring._open(link, token, 4096, 4096)
    finally:
        seg.close(unlink=True)
        if os.path.lexists(os.path.join(shm.SHM_DIR, link)):
            os.unlink(os.path.join(shm.SHM_DIR, link))
        links.close()


def test_workers_calling_different_all_reduces_fail_with_internal_error(monkeypatch):
    # both above the small-buffer size, so both take shared memory: their barrier frames
    # (same size) say which piece of how many bytes each worker is at
    monkeypatch.setattr(shm_ring, "_SMALL_BYTES", 0)
    links = ring_links(2)
    out: list = [None, None]
    sizes = (100_000, 100_002)

    def run(i: int) -> None:
        ring = CrossHostRing(links[i], timeout=5.0)
        try:
            out[i] = ring.all_reduce([np.ones(sizes[i], np.float32)])
        except pf.errors.OpError as e:
            out[i] = (e, ring.shm.active)

    _on_both(run, closing=links)
    assert all(isinstance(o, tuple) and o[1] is True for o in out), out
    assert all(isinstance(o[0], pf.errors.InternalError) for o in out), out
    assert any("different collectives" in str(o[0]) for o in out), out


def _on_both(run: Callable[[int], None], closing: Sequence[Any] = (), count: int = 2) -> None:
    """``run(0)`` and ``run(1)`` (to ``run(count - 1)``) on threads of their own, each
    joined within 30 s; then every object in ``closing`` closed, whatever happened."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for c in closing:
            c.close()


def test_close_unmaps_the_segments_and_a_later_call_is_cancelled(monkeypatch):
    # what an elastic re-form does to the old ring before it forms the new one
    monkeypatch.setattr(shm_ring, "_SMALL_BYTES", 0)
    links = ring_links(2)
    rings = [CrossHostRing(lk, timeout=5.0) for lk in links]
    out: list = [None, None]
    xs = [np.full(1000, i + 1.0, np.float32) for i in range(2)]

    def run(i: int) -> None:
        out[i] = rings[i].all_reduce([xs[i]])[0]

    _on_both(run)
    held = [r.shm._set.slots[0][0] for r in rings]  # a view keeps its mapping alive
    for r in rings:
        r.close()
    assert all(np.array_equal(o, np.full(1000, 3.0, np.float32)) for o in out), out
    assert [r.shm.active for r in rings] == [True, True]
    assert [r.shm._set for r in rings] == [None, None]
    assert held[0].nbytes > 0 and held[0].sum() >= 0  # still readable after close
    with pytest.raises(pf.errors.CancelledError, match="closed"):
        rings[0].all_reduce([xs[0]])


def test_a_full_dev_shm_on_one_worker_keeps_both_on_tcp_and_leaves_nothing(monkeypatch):
    # /dev/shm without room for worker 1's segment (a container's small /dev/shm): its
    # reservation fails at once, as ENOSPC, and the half-made file is removed
    monkeypatch.setattr(shm_ring, "_SMALL_BYTES", 0)
    real = os.posix_fallocate

    def full(fd: int, offset: int, size: int) -> None:
        if "-ring1-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(28, "No space left on device")
        real(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", full)
    links = ring_links(2)
    rings = [CrossHostRing(lk, timeout=5.0) for lk in links]
    out: list = [None, None]
    xs = [np.full(100_000, i + 1.0, np.float32) for i in range(2)]

    def run(i: int) -> None:
        out[i] = rings[i].all_reduce([xs[i]])[0]

    _on_both(run, closing=rings)
    assert all(np.array_equal(o, np.full(100_000, 3.0, np.float32)) for o in out), out
    assert [r.shm.active for r in rings] == [False, False]
    assert rings[1].shm.reason.startswith("no room for")
    assert rings[0].shm.reason.startswith("off on worker:1 (no room for")
    assert _leftovers([os.getpid()]) == []
