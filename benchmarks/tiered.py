"""CTR training with a dynamic table 10x its PS memory budget: the disk tier vs all in memory vs a naive tier.

The model, data and cluster are ``benchmarks/recsys.py``'s (2 PS + 2 worker
processes on loopback, 26 Zipf(1.1) categorical features into one 8-float
``DynamicEmbedding``, Adagrad 0.05), trained three ways, one after the other on
the same batches, in one run:

- **memory**: every row in memory (the data is scaled so it fits);
- **tiered**: each PS started with ``--table-memory-rows`` = a tenth of the rows
  the memory run's shard ended with (so the table is >= 10x the budget), the
  rest on local disk in the default store (``psflow.ps.log_store``; ``--store``
  picks another);
- **naive**: ``--table-memory-rows 1``: every request reads its rows from the
  same store and writes them back (a tier that keeps nothing warm);
- **tiered-lmdb** (the default run only, not ``--quick``): the tiered run on
  LMDB, the other registered store.

Measured: examples/s (ratios tiered/memory, tiered/naive), the CPU time the
two PS tasks and the two workers used per step (``/proc``: robust to a
loaded machine, where examples/s is not), the PS tasks' hit rate and disk
bytes (GetTableStats), test AUC of each run, and each PS's resident memory
sampled every 0.2 s over the whole run: anonymous memory (what the process
owns: the budget lives here) and file-backed pages (the store's memory maps:
page cache the kernel drops under pressure), each against the PS's own at
start.  The tiered run's anonymous growth is checked against the budget in
bytes plus the stated overhead: the PS's own growth under this load beyond
its table (the memory run's growth less its rows' bytes, measured in the same
run: gRPC buffers, request arrays, allocator slack) plus the tier's fixed
structures (the log store: its index, at most ``INDEX_BYTES_PER_ROW`` bytes a
row on disk, and its write queue; LMDB: the id filter, the write-behind queue
and one write transaction's dirty pages).

Prints JSON lines (stdout) and a table (stderr); ``--quick`` trains fewer
steps.  Format: shared/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import _cluster
import cloudpickle
import recsys
from _common import emit, progress, table

# the training closure comes from recsys.py, which the workers cannot import
cloudpickle.register_pickle_by_value(recsys)

BENCH = "tiered"
ROW_BYTES_ADAGRAD = 2 * recsys.DIM * 4 + 23  # row + accumulator + bookkeeping (tiered_table)


def _model(pf):
    """recsys.py's model, defined here: closures pickle it by value from ``__main__``."""
    dim, num_cat, hidden = recsys.DIM, recsys.NUM_CAT, recsys.HIDDEN

    class Model(pf.keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = pf.keras.layers.DynamicEmbedding(dim, table_name="ctr", seed=3)
            self.hidden = pf.keras.layers.Dense(hidden, activation="relu")
            self.out = pf.keras.layers.Dense(1)

        def call(self, inputs, training=None):
            cat, dense = inputs
            e = pf.reshape(self.emb(cat, training=training), (-1, num_cat * dim))
            return self.out(self.hidden(pf.concat([e, dense], axis=1)))

    return Model()


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` used so far (Linux), 0 elsewhere."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total / ticks


def _rss(pid: int) -> tuple[int, int]:
    """``(anonymous, file-backed)`` resident bytes of ``pid`` (Linux), zeros elsewhere."""
    anon = file = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, file


class _Sampler:
    """Samples the PS processes' resident memory until stopped; keeps the peaks."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.start = {p: _rss(p) for p in pids}
        self.peak = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for p in self.pids:
                a, f = _rss(p)
                pa, pf = self.peak[p]
                self.peak[p] = (max(a, pa), max(f, pf))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        return {
            "anon_growth": max(self.peak[p][0] - self.start[p][0] for p in self.pids),
            "file_peak": max(self.peak[p][1] for p in self.pids),
            "anon_start": max(self.start[p][0] for p in self.pids),
        }


def _cluster_with(procs: _cluster.Processes, ps_args: list[str], env: dict) -> dict:
    """2 PS (with ``ps_args``) and 2 workers; returns the cluster dict and the PS pids."""
    ps = []
    for i in range(2):
        ready = procs.start_role(
            "ps_server",
            ["--port", "0", "--task", f"ps:{i}", "--log-level", "WARNING",
             "--bind", "127.0.0.1", *ps_args],
            "ps",
            env,
        )  # fmt: skip
        ps.append(f"127.0.0.1:{ready.port}")
    ps_pids = [proc.pid for proc in procs.procs[:2]]
    workers = []
    for i in range(2):
        ready = procs.start_role(
            "worker",
            ["--port", "0", "--task", f"worker:{i}", "--ps", ",".join(ps), "--workers", "2",
             "--log-level", "WARNING", "--bind", "127.0.0.1"],
            "worker",
            env,
        )  # fmt: skip
        workers.append(f"127.0.0.1:{ready.port}")
    return {"ps": ps, "worker": workers}, ps_pids, [proc.pid for proc in procs.procs[2:4]]


def run(
    data: dict, cluster: dict, ps_pids: list[int], worker_pids: list[int], batch: int, steps: int
) -> dict:
    """Trains ``steps`` batches; returns throughput, AUC, table stats, CPU and memory."""
    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver
    from psflow.keras.datasets import ctr
    from psflow.transport.embedding_client import EmbeddingClient

    sampler = _Sampler(ps_pids)
    resolver = SimpleClusterResolver(
        ClusterSpec({**cluster, "chief": ["127.0.0.1:1"]}), task_type="chief", task_id=0
    )
    pf.random.set_seed(0)
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = _model(pf)
        optimizer = pf.keras.optimizers.Adagrad(0.05)
    coordinator, iterator, step_fn = recsys.ps_training(pf, strategy, model, optimizer, data, batch)

    for _ in range(5):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    cpu_ps, cpu_workers = _cpu_s(ps_pids), _cpu_s(worker_pids)
    start = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    elapsed = time.perf_counter() - start
    cpu_ps, cpu_workers = _cpu_s(ps_pids) - cpu_ps, _cpu_s(worker_pids) - cpu_workers
    test_x = (pf.constant(data["cat_test"]), pf.constant(data["dense_test"]))
    auc = ctr.roc_auc(data["y_test"], model(test_x, training=False).numpy())
    coordinator.shutdown()
    with EmbeddingClient(cluster["ps"], timeout=60) as client:
        shards = [s["ctr"] for s in client.stats()]
    memory = sampler.stop()
    hits = sum(s.memory_hits for s in shards)
    disk = sum(s.disk_hits for s in shards)
    return {
        "examples_per_s": steps * batch / elapsed,
        "ps_cpu_ms_per_step": 1000 * cpu_ps / steps,  # both PS tasks together
        "worker_cpu_ms_per_step": 1000 * cpu_workers / steps,
        "auc": auc,
        "rows_per_ps": max(s.rows for s in shards),
        "rows": sum(s.rows for s in shards),
        "memory_rows_per_ps": max(s.memory_rows for s in shards),
        "hit_rate": hits / (hits + disk) if hits + disk else 1.0,
        "disk_read": sum(s.disk_bytes_read for s in shards),
        "disk_written": sum(s.disk_bytes_written for s in shards),
        "disk_bytes": sum(s.disk_bytes for s in shards),
        **memory,
    }


def _tier_overhead(store: str, budget: int, rows: int) -> int:
    """Bytes the disk tier of a PS may hold besides its budget (``rows``: the shard's)."""
    from psflow.ps.tiered_table import QUEUE_BYTES

    record = 2 * recsys.DIM * 4 + 8  # row, accumulator, clock and traffic
    if store == "log":
        from psflow.ps.log_store import INDEX_BYTES_PER_ROW, record_size

        queue = max(4096, budget // 4, QUEUE_BYTES // record)
        return rows * INDEX_BYTES_PER_ROW + queue * record_size(record)
    from psflow.ps.write_behind import TXN_ROWS

    return (
        2 * rows  # the id filter: 8 bits per id, sized for twice the ids
        + max(4096, budget // 4) * (record + 8)  # the write-behind queue
        + TXN_ROWS * 4096  # one LMDB write transaction: up to a dirty page per record
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--batch", type=int, default=512, help="examples per step")
    p.add_argument("--store", default="", help="the disk tier's store (default: the PS's)")
    args = p.parse_args()
    from psflow.ps.tiered_table import TierOptions

    store = args.store or TierOptions().backend
    batch, steps = args.batch, (40 if args.quick else 200)
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    import numpy as np

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ctr.npz")
        progress("generating data")
        recsys.make_data(path, batch * (steps + 5), 20_000)
        data = dict(np.load(path))
        budget = 0
        modes = ["memory", "tiered", "naive"] + ([] if args.quick or store == "lmdb" else
                                                  ["tiered-lmdb"])  # fmt: skip
        for mode in modes:
            flags = []
            if mode != "memory":
                rows = 1 if mode == "naive" else budget
                flags = ["--table-memory-rows", str(rows), "--table-dir", os.path.join(tmp, mode),
                         "--table-store", "lmdb" if mode == "tiered-lmdb" else store]  # fmt: skip
            progress(f"{mode}: 2 PS + 2 workers {' '.join(flags)}")
            with _cluster.Processes() as procs:
                cluster, ps_pids, worker_pids = _cluster_with(procs, flags, env)
                results[mode] = run(data, cluster, ps_pids, worker_pids, batch, steps)
            if mode == "memory":
                budget = max(1, results["memory"]["rows_per_ps"] // 10)
    mem, tier, naive = results["memory"], results["tiered"], results["naive"]
    budget_bytes = budget * ROW_BYTES_ADAGRAD
    process_overhead = max(0, mem["anon_growth"] - mem["rows_per_ps"] * ROW_BYTES_ADAGRAD)
    tier_overhead = _tier_overhead(store, budget, tier["rows_per_ps"])
    limit = budget_bytes + process_overhead + tier_overhead
    config = {
        "batch": batch,
        "steps": steps,
        "ps": 2,
        "workers": 2,
        "zipf_exponent": 1.1,
        "optimizer": "adagrad(0.05)",
        "memory_rows_per_ps": budget,
        "budget_bytes_per_ps": budget_bytes,
        "process_overhead_bytes": process_overhead,
        "tier_overhead_bytes": tier_overhead,
        "store": store,
        "cores": os.cpu_count(),
    }
    for mode, r in results.items():
        emit(BENCH, mode, "throughput", r["examples_per_s"], "examples/s", config=config)
        emit(BENCH, mode, "auc", r["auc"], "")
        emit(BENCH, mode, "ps_cpu_per_step", r["ps_cpu_ms_per_step"], "ms", tasks=2)
        emit(BENCH, mode, "worker_cpu_per_step", r["worker_cpu_ms_per_step"], "ms", tasks=2)
        emit(BENCH, mode, "hit_rate", r["hit_rate"], "", memory_rows_per_ps=r["memory_rows_per_ps"])
        emit(BENCH, mode, "ps_anon_rss_growth", r["anon_growth"], "B", start=r["anon_start"])
        emit(BENCH, mode, "ps_file_rss_peak", r["file_peak"], "B")
        emit(
            BENCH,
            mode,
            "disk_bytes",
            r["disk_bytes"],
            "B",
            read=r["disk_read"],
            written=r["disk_written"],
        )
    emit(BENCH, "tiered/memory", "ratio", tier["examples_per_s"] / mem["examples_per_s"], "x",
         goal=0.7)  # fmt: skip
    emit(BENCH, "tiered/naive", "ratio", tier["examples_per_s"] / naive["examples_per_s"], "x",
         goal=3.0)  # fmt: skip
    emit(BENCH, "tiered-memory", "auc_delta", tier["auc"] - mem["auc"], "", goal=0.002)
    if "tiered-lmdb" in results:
        lm = results["tiered-lmdb"]
        emit(BENCH, "tiered/tiered-lmdb", "ratio", tier["examples_per_s"] / lm["examples_per_s"],
             "x", stores=[store, "lmdb"])  # fmt: skip
    emit(
        BENCH,
        "tiered",
        "table_to_budget",
        tier["rows_per_ps"] / budget,
        "x",
        rows=tier["rows"],
        memory_rows_per_ps=budget,
    )
    under = tier["anon_growth"] <= limit
    emit(BENCH, "tiered", "rss_under_budget", float(under), "bool", anon_growth=tier["anon_growth"],
         limit=limit, budget=budget_bytes, process_overhead=process_overhead,
         tier_overhead=tier_overhead)  # fmt: skip
    rows = [
        [
            mode,
            f"{r['examples_per_s']:.0f}",
            f"{r['ps_cpu_ms_per_step']:.1f}",
            f"{r['worker_cpu_ms_per_step']:.1f}",
            f"{r['auc']:.4f}",
            f"{r['hit_rate']:.3f}",
            f"{r['anon_growth'] / 2**20:.0f}",
            f"{r['file_peak'] / 2**20:.0f}",
            f"{r['disk_bytes'] / 2**20:.0f}",
        ]
        for mode, r in results.items()
    ]
    table(
        ["mode", "examples/s", "PS ms/step", "worker ms/step", "AUC", "hit rate",
         "PS anon +MiB", "PS file MiB", "disk MiB"],
        rows,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
