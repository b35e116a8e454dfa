"""Keepalive on the chief's worker channels: a worker whose host goes silent is noticed;
and a channel to a PS whose path healed is used again within about a second.

A partition that keeps TCP up (the chaos relay holds every byte, no reset) on
the chief -> worker path leaves a RunClosure waiting for its own deadline (an
hour by default) unless something pings the connection.  The chief's channel
to each worker pings as its channels to the PS do; a ping unanswered for the
keepalive timeout drops the connection, the closure fails as a lost worker's
and is re-queued.  A closure on the worker's data plane fails the same way
once a health probe goes unanswered with the worker silent for the keepalive
timeout.  The health probe would mark the worker down too, after its grace:
the tests set that grace far beyond the fault, so keepalive alone must do it.
"""

from __future__ import annotations

import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import psflow as pf
from psflow.distribute.coordinator.config import CoordinatorConfig
from psflow.transport.options import channel_options
from tests import netfault_scenario as scenario
from tests.conftest import ROOT
from tests.test_netfault import relayed_cluster  # noqa: F401  (the fixture)

sys.path.insert(0, str(ROOT / "benchmarks"))
import _netfault

KEEPALIVE = 1.0  # seconds between pings, and seconds a ping may go unanswered


def test_keepalive_settings_default_to_the_ps_channels_and_refuse_bad_values():
    from psflow.transport.options import channel_options

    cfg = CoordinatorConfig.from_environ({})
    ps = dict(channel_options())
    assert cfg.keepalive_time * 1000 == ps["grpc.keepalive_time_ms"]
    assert cfg.keepalive_timeout * 1000 == ps["grpc.keepalive_timeout_ms"]
    cfg = CoordinatorConfig.from_environ(
        {"PSFLOW_WORKER_KEEPALIVE_TIME": "2.5", "PSFLOW_WORKER_KEEPALIVE_TIMEOUT": "0.5"}
    )
    assert (cfg.keepalive_time, cfg.keepalive_timeout) == (2.5, 0.5)
    for name in ("PSFLOW_WORKER_KEEPALIVE_TIME", "PSFLOW_WORKER_KEEPALIVE_TIMEOUT"):
        for raw in ("0", "-1", "soon", "inf"):
            with pytest.raises(pf.errors.InvalidArgumentError, match=f"{name}.*{raw}"):
                CoordinatorConfig.from_environ({name: raw})


@pytest.mark.slow
def test_a_worker_partitioned_from_the_chief_is_noticed_by_keepalive_and_its_closures_move(
    relayed_cluster,  # noqa: F811
    monkeypatch,
):
    cluster = relayed_cluster()
    monkeypatch.setenv("PSFLOW_HEALTH_GRACE", "300")  # the probe must not be what notices
    monkeypatch.setenv("PSFLOW_WORKER_KEEPALIVE_TIME", str(KEEPALIVE))
    monkeypatch.setenv("PSFLOW_WORKER_KEEPALIVE_TIMEOUT", str(KEEPALIVE))
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver)
    # chief -> worker:1 only (its gRPC port and its data plane): worker:1 still reaches the PS
    to_worker = cluster.paths[1][:2]
    result = scenario.run_fault(
        strategy,
        lambda: [r.stall() for r in to_worker],
        lambda: [r.heal() for r in to_worker],
        8.0,
    )
    # exact counts: every closure applied once, worker:1's moved to worker:0, worker:1 back
    scenario.check(result)
    assert all(r.stats()["resets"] == 0 for r in to_worker)  # silent: no reset told anyone
    assert to_worker[1].stats()["bytes_up"] > 0  # the closures took the data plane
    noticed = min(t for t, up in result["workers_up"] if t > result["down"] and up == 1)
    # a ping at most KEEPALIVE after the stall, unanswered for KEEPALIVE; slack for a
    # loaded machine, still far below the probe's grace and the closure's deadline
    assert noticed - result["down"] < 2 * KEEPALIVE + 3.0, noticed - result["down"]


@pytest.mark.slow
def test_a_ps_channel_is_used_again_within_about_a_second_of_its_path_healing(start_ps):
    """Ten seconds of resets: gRPC's default backoff would wait ~6 s more (its attempts at
    about 1, 2.6, 5.2, 9.3, 15.9 s); psflow's caps it at a second."""
    server = start_ps()
    with _netfault.ChaosRelay(server.address) as relay:
        channel = grpc.insecure_channel(relay.address, options=channel_options())
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        try:
            stub.Check(request, timeout=10)
            relay.cut()
            cut = time.monotonic()
            refused = 0
            while time.monotonic() - cut < 10:  # every attempt reset: the backoff grows
                try:
                    stub.Check(request, timeout=0.5)
                except grpc.RpcError:
                    refused += 1
                time.sleep(0.1)
            assert refused > 0
            relay.heal()
            healed = time.monotonic()
            while time.monotonic() - healed < 30:
                try:
                    stub.Check(request, timeout=1)
                    break
                except grpc.RpcError:
                    time.sleep(0.02)
            back = time.monotonic() - healed
        finally:
            channel.close()
    assert back < 2.5, back
