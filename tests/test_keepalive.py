"""Keepalive on the chief's worker channels: a worker whose host goes silent is noticed.

A partition that keeps TCP up (the chaos relay holds every byte, no reset) on
the chief -> worker path leaves a RunClosure waiting for its own deadline (an
hour by default) unless something pings the connection.  The chief's channel
to each worker pings as its channels to the PS do; a ping unanswered for the
keepalive timeout drops the connection, the closure fails as a lost worker's
and is re-queued.  The health probe would notice too, after its grace: the
tests set that grace far beyond the fault, so keepalive alone must do it.
"""

from __future__ import annotations

import pytest

import psflow as pf
from psflow.distribute.coordinator.config import CoordinatorConfig
from tests import netfault_scenario as scenario
from tests.test_netfault import relayed_cluster  # noqa: F401  (the fixture)

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
    to_worker = cluster.paths[1][0]  # chief -> worker:1 only: worker:1 still reaches the PS
    result = scenario.run_fault(strategy, to_worker.stall, to_worker.heal, 8.0)
    # exact counts: every closure applied once, worker:1's moved to worker:0, worker:1 back
    scenario.check(result)
    assert to_worker.stats()["resets"] == 0  # a silent partition: no reset told anyone
    noticed = min(t for t, up in result["workers_up"] if t > result["down"] and up == 1)
    # a ping at most KEEPALIVE after the stall, unanswered for KEEPALIVE; slack for a
    # loaded machine, still far below the probe's grace and the closure's deadline
    assert noticed - result["down"] < 2 * KEEPALIVE + 3.0, noticed - result["down"]
