"""Recovery times of parameter-server training (failure -> training resumed), real processes.

Three cases, each on a local cluster of 2 parameter servers and 2 workers, the
chief training a small model with ``model.fit`` and ``BackupAndRestore``:

* worker: one worker is killed (SIGKILL) mid-epoch; measured: kill -> the next
  completed step, and kill -> a replacement process in the same slot (started
  0.5 s after the kill) running closures again;
* ps: one parameter server is killed and restarted 0.5 s later; measured:
  kill -> the first step completed after every PS rolled back to the backup;
* chief: the chief is killed and started again; measured: kill -> the new
  chief's first completed step (process start, imports, reconnection and the
  restore included);
* worker lost for good: one worker is killed and not restarted; measured: kill
  -> the next completed step on the survivor, and the whole run's time as a
  ratio to an undisturbed run measured in the same invocation;
* worker frozen: one worker is stopped (SIGSTOP) for 15 s (6 s with
  ``--quick``); measured: steps/s during the freeze as a fraction of the
  undisturbed rate just before it (of the whole cluster, and of the healthy
  worker's half of it).

Prints JSON lines and a table; ``--quick`` runs each case once.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import _cluster
from _common import emit, progress, table

BENCH = "recovery"

CHIEF = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

    ps, workers, backup, epochs = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3], int(sys.argv[4])
    resolver = SimpleClusterResolver(ClusterSpec({"ps": ps, "worker": workers, "chief": ["127.0.0.1:1"]}),
                                     task_type="chief", task_id=0)
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = pf.keras.Sequential([pf.keras.layers.Dense(32, activation="relu", input_shape=(16,)),
                                     pf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 16)).astype("float32"); y = x.sum(axis=1, keepdims=True)

    class Stamp(pf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print("STEP", time.time(), flush=True)

    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0,
              callbacks=[pf.keras.callbacks.BackupAndRestore(backup), Stamp()])
    print("DONE", time.time(), flush=True)
    """
)


def _run_case(kind: str, freeze_s: float = 15.0) -> dict[str, float]:
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PSFLOW_PS_RECOVERY_TIMEOUT": "60"}
    with _cluster.Processes() as procs, tempfile.TemporaryDirectory() as tmp:
        cluster = _cluster.psflow_cluster(procs, 2, 2, env)
        script = os.path.join(tmp, "chief.py")
        with open(script, "w") as f:
            f.write(CHIEF)
        args = [
            sys.executable,
            script,
            ",".join(cluster["ps"]),
            ",".join(cluster["worker"]),
            os.path.join(tmp, "backup"),
            "200" if kind == "worker_frozen" else "4",
        ]
        chief = subprocess.Popen(
            args, stdout=subprocess.PIPE, text=True, env=_cluster.child_env(env), cwd=_cluster.ROOT
        )
        procs.procs.append(chief)
        stamps: list[float] = []
        out: dict[str, float] = {}
        killed_at = None
        restarted: list[subprocess.Popen] = []
        deadline = time.monotonic() + 300
        started = time.time()
        for line in chief.stdout:
            if time.monotonic() > deadline:
                break
            if line.startswith("STEP"):
                stamps.append(float(line.split()[1]))
            if kind == "worker_frozen" and len(stamps) >= 150:
                _freeze(procs.procs[2 + 1], stamps, chief, freeze_s, out)
                break
            if kind == "none" and line.startswith("DONE"):
                out["run_s"] = float(line.split()[1]) - started
                break
            if killed_at is None and len(stamps) == 150 and kind != "none":  # mid second epoch
                killed_at = time.time()
                if kind == "worker":
                    victim = procs.procs[2 + 1]
                    port = cluster["worker"][1].rsplit(":", 1)[1]
                    victim.send_signal(signal.SIGKILL)

                    def restart_worker(port=port, killed_at=killed_at):
                        time.sleep(0.5)
                        p, _ = procs.start(
                            [
                                sys.executable,
                                "-m",
                                "worker",
                                "--port",
                                port,
                                "--task",
                                "worker:1",
                                "--ps",
                                ",".join(cluster["ps"]),
                                "--workers",
                                "2",
                                "--log-level",
                                "WARNING",
                            ],
                            "PSFLOW_READY worker",
                            env,
                        )
                        restarted.append(p)
                        out["replacement_ready_s"] = time.time() - killed_at

                    threading.Thread(target=restart_worker, daemon=True).start()
                elif kind == "worker_lost":
                    procs.procs[2 + 1].send_signal(signal.SIGKILL)
                elif kind == "ps":
                    victim = procs.procs[1]
                    port = cluster["ps"][1].rsplit(":", 1)[1]
                    victim.send_signal(signal.SIGKILL)

                    def restart_ps(port=port):
                        time.sleep(0.5)
                        procs.start(
                            [
                                sys.executable,
                                "-m",
                                "ps_server",
                                "--port",
                                port,
                                "--task",
                                "ps:1",
                                "--log-level",
                                "WARNING",
                            ],
                            "PSFLOW_READY ps",
                            env,
                        )

                    threading.Thread(target=restart_ps, daemon=True).start()
                else:  # chief
                    chief.send_signal(signal.SIGKILL)
                    chief.wait(30)
                    chief = subprocess.Popen(
                        args,
                        stdout=subprocess.PIPE,
                        text=True,
                        env=_cluster.child_env(env),
                        cwd=_cluster.ROOT,
                    )
                    procs.procs.append(chief)
                    for line2 in chief.stdout:
                        if line2.startswith("STEP"):
                            out["resumed_s"] = float(line2.split()[1]) - killed_at
                            break
                    break
                continue
            if killed_at is not None and "resumed_s" not in out and line.startswith("STEP"):
                t = float(line.split()[1])
                if kind != "ps" or t - killed_at > 0.5:  # ps: the first step after the rollback
                    out["resumed_s"] = t - killed_at
            if line.startswith("DONE"):
                out["run_s"] = float(line.split()[1]) - started
                break
        if kind == "worker" and restarted:
            from psflow.distribute.coordinator.workers import GrpcWorker

            status = GrpcWorker(1, cluster["worker"][1]).status()
            out["replacement_used"] = float(status.closures_run > 0)
        return out


def _freeze(victim: subprocess.Popen, stamps: list[float], chief, freeze_s: float, out) -> None:
    """Stops ``victim`` for ``freeze_s`` and compares the chief's step rate then and before."""
    before = [t for t in stamps if t >= stamps[-1] - 1.0]
    rate_before = (len(before) - 1) / max(before[-1] - before[0], 1e-9)
    stopped = time.time()
    victim.send_signal(signal.SIGSTOP)
    during: list[float] = []
    try:
        for line in chief.stdout:
            if line.startswith("STEP"):
                t = float(line.split()[1])
                if t - stopped > freeze_s:
                    break
                during.append(t)
            if time.time() - stopped > freeze_s + 30:
                break
    finally:
        victim.send_signal(signal.SIGCONT)
        chief.kill()
    rate_during = len(during) / freeze_s
    out["rate_before"] = rate_before
    out["rate_during"] = rate_during
    out["fraction"] = rate_during / rate_before
    out["fraction_of_own_share"] = rate_during / (rate_before / 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    repeats = 1 if args.quick else 3
    freeze_s = 6.0 if args.quick else 15.0
    rows = []
    baseline = []
    for r in range(repeats):
        progress(f"undisturbed run {r + 1}/{repeats}")
        baseline.append(_run_case("none").get("run_s", float("nan")))
    base_s = statistics.median(baseline)
    emit(BENCH, "none", "run_time", base_s, "s", n=len(baseline))
    frozen = []
    for r in range(repeats):
        progress(f"worker frozen {freeze_s:g} s, run {r + 1}/{repeats}")
        frozen.append(_run_case("worker_frozen", freeze_s))
    if all("fraction" in f for f in frozen):
        frac = statistics.median(f["fraction"] for f in frozen)
        own = statistics.median(f["fraction_of_own_share"] for f in frozen)
        emit(
            BENCH,
            "worker_frozen",
            "ratio",
            frac,
            "",
            freeze_s=freeze_s,
            fraction_of_own_share=own,
            rate_before=statistics.median(f["rate_before"] for f in frozen),
            rate_during=statistics.median(f["rate_during"] for f in frozen),
            compares="steps/s during the freeze / steps/s just before it",
        )
    for kind in ("worker", "worker_lost", "ps", "chief"):
        results = []
        for r in range(repeats):
            progress(f"{kind} failure, run {r + 1}/{repeats}")
            results.append(_run_case(kind))
        resumed = [r["resumed_s"] for r in results if "resumed_s" in r]
        if not resumed:
            emit(BENCH, kind, "skipped", 0, "", reason="training did not resume")
            continue
        med = statistics.median(resumed)
        extra = {}
        if kind == "worker":
            extra["replacement_ready_s"] = statistics.median(
                r.get("replacement_ready_s", float("nan")) for r in results
            )
            extra["replacement_used"] = all(r.get("replacement_used") for r in results)
        if kind == "worker_lost":
            run_s = statistics.median(r.get("run_s", float("nan")) for r in results)
            extra["slowdown"] = run_s / base_s
        emit(BENCH, kind, "recovery_time", med, "s", n=len(resumed), **extra)
        rows.append(
            [
                kind,
                round(med, 3),
                extra.get("replacement_ready_s", "-"),
                round(extra["slowdown"], 2) if "slowdown" in extra else "-",
            ]
        )
    if all("fraction" in f for f in frozen):
        rows.append(
            [f"worker_frozen {freeze_s:g}s", "-", "-", f"rate x{frac:.2f} ({own:.2f} of own)"]
        )
    table(["failure", "failure -> resumed (s)", "replacement ready (s)", "run slowdown"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
