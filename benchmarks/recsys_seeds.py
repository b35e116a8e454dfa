"""Test AUC of recsys.py's CTR model over several seeds: hybrid mode vs async PS mode.

One seed is one draw: the initial weights and the training examples' order
(``recsys.py --seed``). Synchronous training (hybrid mode, one process) gives
the same AUC every run at a seed; async PS training varies with the
scheduling as well, so it runs ``--async-runs`` times per seed. Each run is
recsys.py's full length (200 timed steps of 512 after 5 warm-up steps, equal
examples on every side; ``--quick``: 30), no TensorFlow.

Sides: async (2 PS + 2 workers), hybrid at global batch 512 (the single
process's updates), hybrid at 1024 with twice the learning rate (the async
side's 512 per worker step kept per replica, linear scaling), one process.

Prints a JSON line per seed, then per side the mean, standard deviation and
standard error over seeds (async: of all its runs), and hybrid − async paired
by seed (async's per-seed mean) as mean ± standard error: the question is
whether a gap between the sides is larger than the draw-to-draw spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import _cluster
import cloudpickle
import numpy as np
import recsys

# the workers import no benchmark module: recsys's step functions travel by value,
# as they do when recsys.py runs as the main script
cloudpickle.register_pickle_by_value(recsys)

BATCH = 512
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def one_seed(seed: int, steps: int, async_runs: int) -> dict:
    """Every side's test AUC at ``seed``."""
    out: dict = {"seed": seed, "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ctr.npz")
        recsys.make_data(path, BATCH * (steps + 5), 20_000, seed)
        data = dict(np.load(path))
        for _ in range(async_runs):
            with _cluster.Processes() as procs:
                cluster = _cluster.psflow_cluster(procs, 2, 2, ENV)
                pids = {
                    "ps": [proc.pid for proc in procs.procs[:2]],
                    "worker": [proc.pid for proc in procs.procs[2:4]],
                }
                out["async"].append(
                    recsys.run_psflow(data, cluster, pids, BATCH, steps, seed)["auc"]
                )
        out["hybrid_512"] = recsys.run_hybrid(path, ENV, BATCH, 5, steps, 0.05, BATCH, seed)["auc"]
        twice = (steps + 5) // 2 - 2  # recsys.py's equal examples at the doubled batch
        out["hybrid_1024_lr2x"] = recsys.run_hybrid(
            path, ENV, 2 * BATCH, 2, twice, 0.1, BATCH, seed
        )["auc"]
        out["single"] = recsys.single_process_auc(data, BATCH, steps, seed)
    return out


def spread(values: list[float]) -> dict:
    """Mean, standard deviation, standard error and range of ``values``."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "sd": sd,
        "se": sd / len(values) ** 0.5,
        "min": min(values),
        "max": max(values),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0-8", help="seeds, a range a-b or a list a,b,c (0-8)")
    p.add_argument("--async-runs", type=int, default=3, help="async runs per seed (3)")
    p.add_argument("--quick", action="store_true", help="seeds 0-2, one async run, 30 steps")
    args = p.parse_args()
    if args.quick:
        seeds, async_runs, steps = [0, 1, 2], 1, 30
    else:
        lo, _, hi = args.seeds.partition("-")
        seeds = list(range(int(lo), int(hi) + 1)) if hi else [int(s) for s in lo.split(",")]
        async_runs, steps = args.async_runs, 200
    rows = []
    for seed in seeds:
        print(f"[recsys_seeds] seed {seed}", file=sys.stderr, flush=True)
        row = one_seed(seed, steps, async_runs)
        rows.append(row)
        print(json.dumps({"bench": "recsys_seeds", **row}), flush=True)
    summary = {"async": spread([a for r in rows for a in r["async"]])}
    for side in ("hybrid_512", "hybrid_1024_lr2x", "single"):
        summary[side] = spread([r[side] for r in rows])
    for side in ("hybrid_512", "hybrid_1024_lr2x"):
        summary[f"{side}_minus_async"] = spread(
            [r[side] - statistics.fmean(r["async"]) for r in rows]
        )
    print(json.dumps({"bench": "recsys_seeds", "summary": summary, "steps": steps}), flush=True)
    print(f"\n{'side':<28}{'n':>4}{'mean':>10}{'sd':>9}{'se':>9}   range")
    for side, s in summary.items():
        print(
            f"{side:<28}{s['n']:>4}{s['mean']:>10.4f}{s['sd']:>9.4f}{s['se']:>9.4f}"
            f"   {s['min']:.4f} .. {s['max']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
