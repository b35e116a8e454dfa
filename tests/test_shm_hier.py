"""The all-reduce of several workers on each of several hosts (psflow/collective/shm_hier.py).

Real worker processes on 127.0.0.1 (``tests/shm_ring_scenario.py``), made into "hosts"
by ``PSFLOW_HOST_ID``: shared memory inside each, TCP rings across them; their results
compared with NumPy and with each other, faults real signals sent mid-call.
"""

from __future__ import annotations

import ssl
import threading

import numpy as np
import pytest

import psflow as pf
from psflow.collective import peer_link, shm_hier
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.peer_link import PeerLinks
from psflow.collective.shm_hier import _groups, host_key
from psflow.security.config import SecurityConfig
from psflow.transport import shm
from tests.multi_worker_util import LOST_PEER_FAULTS
from tests.test_shm_ring import _check_sums, _leftovers, _on_both, _run

pytestmark = pytest.mark.skipif(
    shm.sharing_unavailable_reason() is not None, reason="no shared memory on this platform"
)

# slots of 16 kB growing to 64 kB (the 2.4 MB call in many pieces); every buffer through
# the hierarchy, the smallest too (SHM_RING_SMALL=0), or those under 128 kB on the flat ring
_SUMS_ENV = {"SHM_RING_MIN": str(16 << 10), "SHM_RING_CAP": str(64 << 10)}


def _hosts(ids: str) -> dict[int, dict[str, str]]:
    """Each rank's ``PSFLOW_HOST_ID``: ``"aabb"`` puts ranks 0, 1 on host a, 2, 3 on b."""
    return {rank: {"PSFLOW_HOST_ID": h} for rank, h in enumerate(ids)}


def _expected_groups(ids: str) -> list[list[int]]:
    found: dict[str, list[int]] = {}
    for rank, h in enumerate(ids):
        found.setdefault(h, []).append(rank)
    return list(found.values())


@pytest.mark.parametrize(
    ("ids", "small"),
    [("aabb", "0"), ("abab", "0"), ("aaabbb", None), ("aabbcc", "0")],
)
def test_hosts_of_several_workers_sum_to_the_same_bits_through_the_hierarchy(tmp_path, ids, small):
    n = len(ids)
    env = dict(_SUMS_ENV)
    if small is not None:
        env["SHM_RING_SMALL"] = small
    codes, results, logs, pids = _run(tmp_path, "sums", n, env, _hosts(ids), timeout=120)
    assert codes == [0] * n, "\n---\n".join(lg[-3000:] for lg in logs)
    for r in results:
        assert r["hier"] is True and r["hier_reason"] is None, r  # not the flat paths
        assert r["active"] is None, r  # the one-host path was never agreed
        assert r["groups"] == _expected_groups(ids)
        assert r["slot_bytes"] == 64 << 10  # the host's segments grew, in every group
        assert r["leftover"] == []
        assert r["spread_same_bits"] == [True, True]
    # identical bits everywhere; within (N+1) ulps of the magnitudes' sum of NumPy's sum
    # (N-1 additions in any order, and a mean's division)
    _check_sums(tmp_path, n)
    assert _leftovers(pids) == []
    for log in logs:
        assert "go through shared memory on each of" in log
        assert "stay on TCP" not in log and "no host hierarchy" not in log


def _sums_off(tmp_path, n: int, env: dict, per_rank: dict, *lines: str) -> list[dict]:
    """Runs the sums mode where the hierarchy must be off: every worker exits 0 with
    NumPy's sums in the same bits, logs each of ``lines`` once (and no other word of the
    hierarchy), leaves nothing in /dev/shm; each worker's result record."""
    codes, results, logs, pids = _run(tmp_path, "sums", n, env, per_rank)
    assert codes == [0] * n, "\n---\n".join(lg[-3000:] for lg in logs)
    for r in results:
        assert r["hier"] is False, r
    for log in logs:
        assert all(log.count(line) == 1 for line in lines), log
        assert "on each of" not in log and log.count("host hierarchy") == lines.count(
            "no host hierarchy"
        )
    _check_sums(tmp_path, n)
    assert _leftovers(pids) == []
    return results


def test_workers_of_one_host_keep_the_one_host_path_without_a_word(tmp_path):
    # one host key (this host's boot id, network namespace and /dev/shm): G = 1; the
    # one-host path says nothing when on
    results = _sums_off(tmp_path, 3, _SUMS_ENV, {})
    for r in results:
        assert r["hier_reason"] is None and r["groups"] == [[0, 1, 2]], r
        assert r["active"] is True, r


def test_hosts_of_different_sizes_keep_the_one_host_rules_and_say_why(tmp_path):
    results = _sums_off(tmp_path, 4, _SUMS_ENV, _hosts("aaab"), "no host hierarchy")
    for r in results:
        assert "different numbers of workers ([3, 1])" in r["hier_reason"], r
        assert r["active"] is True, r  # every worker on loopback: the one-host rule, as before


def test_shared_memory_off_on_one_worker_keeps_every_worker_on_the_flat_tcp_ring(tmp_path):
    per_rank = _hosts("aabb")
    per_rank[2]["PSFLOW_SHM"] = "0"
    results = _sums_off(tmp_path, 4, _SUMS_ENV, per_rank, "no host hierarchy", "stay on TCP")
    for rank, r in enumerate(results):
        assert r["active"] is False and "PSFLOW_SHM=0" in r["hier_reason"], r
        assert rank == 2 or "off on worker:2" in r["hier_reason"], r
        assert "PSFLOW_SHM=0" in r["reason"], r  # the flat TCP ring, said once as before


def test_a_ring_between_the_hosts_that_does_not_connect_turns_the_hierarchy_off_everywhere(
    tmp_path,
):
    # worker 3's group and rail ports accept nobody: 2 (its group) and 1 (its rail) cannot
    # dial it, 3 accepts nothing; every worker learns it and keeps the one-host rules
    per_rank = _hosts("aabb")
    per_rank[3]["HIER_DEAF"] = "1"
    env = {**_SUMS_ENV, "RING_TIMEOUT": "3"}
    results = _sums_off(tmp_path, 4, env, per_rank, "no host hierarchy")
    for rank, r in enumerate(results):
        assert r["active"] is True, r
        if rank == 0:  # its own rings came up: it names the first worker whose did not
            assert "off on worker:1" in r["hier_reason"], r
        else:
            assert "did not connect" in r["hier_reason"], r


@pytest.mark.parametrize("where", ["barrier", "rail"])
@pytest.mark.parametrize(("fault", "errors_allowed"), LOST_PEER_FAULTS)
def test_a_worker_lost_mid_call_gives_every_survivor_of_every_host_a_typed_error_naming_it(
    tmp_path, fault, errors_allowed, where
):
    # worker 1 of hosts {0, 1} and {2, 3}: 0 shares its host, 3 its rail, 2 neither
    timeout = 2.0
    env = {"KILL_RANK": "1", "KILL_SIGNAL": fault, "RING_TIMEOUT": str(timeout), "KILL_IN": where}
    codes, results, logs, pids = _run(
        tmp_path, "kill", 4, env, _hosts("aabb"), wait_for={0, 2, 3}, timeout=60
    )
    for rank in (0, 2, 3):
        assert codes[rank] == 3, logs[rank][-3000:]
        result = results[rank]
        assert result["error"] in errors_allowed, result
        assert "worker:1 at 127.0.0.1:" in result["message"], result
        assert result["seconds"] < 2 * timeout + 3, result
        assert "go through shared memory on each of" in logs[rank]
    assert _leftovers(pids) == []


def test_the_group_and_rail_listeners_refuse_a_wrong_token():
    # two members of a sub-ring as the hierarchy makes them (a listener on port 0, the
    # workers' global ids), one with another token: each refuses the other's HELLO
    listeners = [peer_link.listen("127.0.0.1:0", SecurityConfig(token="r" * 24), "w") for _ in "ab"]
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in listeners]
    tokens = ("r" * 24, "w" * 24)
    rings = [
        PeerLinks(i, addresses, SecurityConfig(token=tokens[i]), listener=listeners[i], ids=[0, 3])
        for i in range(2)
    ]
    out: list = [None, None]

    def run(i: int) -> None:
        try:
            rings[i].connect(3.0)
        except pf.errors.OpError as e:
            out[i] = e

    _on_both(run, closing=rings)
    assert [type(e) for e in out] == [pf.errors.UnauthenticatedError] * 2, out
    assert "worker:3" in str(out[0]) and "worker:0" in str(out[1]), out


def test_host_groups_order_and_keys():
    assert _groups([b"x", b"y", b"x", b"z", b"y"]) == [[0, 2], [1, 4], [3]]
    assert host_key() == host_key()


def test_a_host_without_proc_groups_nobody(monkeypatch):
    """macOS and Windows have no /proc: every worker is a host of its own (no grouping, so
    the hierarchy stays off), the same key for the whole process."""
    monkeypatch.delenv("PSFLOW_HOST_ID", raising=False)
    real_stat = shm_hier.os.stat

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(shm_hier.os, "stat", no_proc)
    key = host_key()
    assert key.startswith("process:") and key == host_key()
    monkeypatch.undo()
    assert host_key() != key


def test_the_host_id_overrides_the_host_key(monkeypatch):
    monkeypatch.setenv("PSFLOW_HOST_ID", "rack7-node3")
    assert host_key() == "id:rack7-node3"
    monkeypatch.delenv("PSFLOW_HOST_ID")
    assert host_key() != "id:rack7-node3"


def test_the_hierarchy_runs_over_mutual_tls(tmp_path, monkeypatch):
    # four workers on threads of this process, hosts {0, 1} and {2, 3} by the thread's
    # name: the group and rail rings are TLS links as the ring's are
    from tests.test_auth_tls import make_pki, tls

    where = threading.local()  # each worker thread's host
    monkeypatch.setattr(shm_hier, "host_key", lambda: where.host)
    security = tls(make_pki(tmp_path))
    listeners = [peer_link.listen("127.0.0.1:0", security, f"worker:{i}") for i in range(4)]
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in listeners]
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(300_001).astype(np.float32) for _ in range(4)]
    rings = [
        CrossHostRing(PeerLinks(i, addresses, security, listener=s), 10.0)
        for i, s in enumerate(listeners)
    ]
    out: list = [None] * 4

    def worker(i: int) -> None:
        where.host = "ab"[i // 2]
        try:
            rings[i].links.connect(10.0)
            out[i] = rings[i].all_reduce([inputs[i]], divisor=4)[0]
        except pf.errors.OpError as e:
            out[i] = e

    _on_both(worker, closing=rings, count=4)
    assert all(isinstance(o, np.ndarray) for o in out), out
    assert [r.hier.active for r in rings] == [True] * 4
    assert [r.hier.groups for r in rings] == [[[0, 1], [2, 3]]] * 4
    for r in rings:  # both new rings' links are TLS sockets
        for links in (r.hier.group_links, r.hier.rail.links):
            assert isinstance(links._right.sock, ssl.SSLSocket), links
    assert all(np.array_equal(o, out[0]) for o in out[1:])
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0) / 4
    np.testing.assert_allclose(out[0], exact, rtol=1e-5, atol=1e-6)
