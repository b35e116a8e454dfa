"""All-reduce bandwidth of psflow's cross-device ops, side by side with NumPy copy and TF.

For float32 buffers of 1M, 16M and 64M elements on 2, 4 and 8 logical CPU
devices, measures (nccl-tests' definitions, S = bytes of one replica's buffer):

    algbw = S / t        busbw = algbw * 2(n-1)/n

for psflow's ``ring`` (new result arrays, the default), ``ring/inplace``
(``out=`` the inputs), ``reduce_to_one``, and ``nccl`` when CuPy sees >= 2 GPUs
(else a ``skipped`` line); next to ``numpy_copy`` (``np.copyto`` of S bytes,
S/t) measured in the same loop.  All variants of a case are timed in turn,
A B C A B C, and the median is reported.

With TensorFlow installed, each replica count also runs in a subprocess (so
TF's thread pools do not disturb ours) that times TF's all-reduce inside
``MirroredStrategy.run`` on N logical CPU devices: the default
``CollectiveAllReduce`` with ``CommunicationImplementation.RING`` (TF's ring),
``ReductionToOneDevice`` and ``HierarchicalCopyAllReduce``, alternated with a
NumPy copy in that process; ratio lines compare psflow with TF's ring.
Note that on CPUs TF's reduce-to-one and hierarchical copy hand every replica
the same buffer (no copies), whereas psflow gives each replica its own.

Usage: python benchmarks/allreduce.py [--quick] [--no-tf]
Output: JSON lines on stdout (see BENCHMARKS.md), a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout: use its psflow
    sys.path.insert(0, ROOT)

BENCH = "allreduce"
T0 = time.monotonic()
SIZES = {"1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20}
# In-place runs multiply the data by N each call; starting tiny keeps it finite.
START_SCALE = 2.0**-64


def emit(**fields):
    """One JSON line on stdout."""
    print(json.dumps({"bench": BENCH, **fields}), flush=True)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def busbw(algbw, n):
    return algbw * 2 * (n - 1) / n if n > 1 else algbw


def time_alternating(fns, reps):
    """Times each named fn ``reps`` times, in turn (A B C A B C); returns seconds lists."""
    times = {k: [] for k in fns}
    for f in fns.values():  # warm-up
        f()
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


def make_inputs(n, size, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.random(size, dtype=np.float32)
    base -= 0.5
    base *= START_SCALE
    out = []
    for r in range(n):
        x = base * np.float32(r + 1) if r else base
        out.append([x])
    return out


def report(case_op, n, label, nbytes, secs, baseline=None):
    t = float(np.median(secs))
    alg = nbytes / t / 1e9
    fields = dict(
        case=f"{case_op}/n{n}/{label}",
        metric="algbw",
        value=round(alg, 3),
        unit="GB/s",
        busbw=round(busbw(alg, n), 3),
        n=n,
        bytes=nbytes,
        p50_ms=round(t * 1e3, 3),
        p99_ms=round(float(np.percentile(secs, 99)) * 1e3, 3),
        reps=len(secs),
    )
    if baseline:
        fields["baseline"] = baseline
    emit(**fields)
    return alg


def run_psflow(replicas, sizes, reps, results):
    import psflow.collective as coll

    ops = {
        "ring": coll.RingAllReduce(),
        "reduce_to_one": coll.ReductionToOneDevice(),
    }
    for n in replicas:
        for label in sizes:
            size = SIZES[label]
            nbytes = size * 4
            xs = make_inputs(n, size)
            dst = np.empty_like(xs[0][0])
            fns = {
                "numpy_copy": lambda xs=xs, dst=dst: np.copyto(dst, xs[0][0]),
                "ring": lambda xs=xs: ops["ring"].all_reduce(xs),
                "ring/inplace": lambda xs=xs: ops["ring"].all_reduce(xs, out=xs),
                "reduce_to_one": lambda xs=xs: ops["reduce_to_one"].all_reduce(xs),
            }
            log(f"psflow: n={n} size={label} ... ({time.monotonic() - T0:.0f} s)")
            times = time_alternating(fns, reps(label))
            for name, secs in times.items():
                results[(name, n, label)] = report(name, n, label, nbytes, secs)
            copy = results[("numpy_copy", n, label)]
            for name in ("ring", "ring/inplace", "reduce_to_one"):
                emit(
                    case=f"{name}/n{n}/{label}",
                    metric="ratio",
                    value=round(results[(name, n, label)] / copy, 3),
                    baseline="numpy_copy",
                    compared=f"{name} algbw / numpy_copy S/t",
                )
            del xs, dst, fns, times
    for o in ops.values():
        o.close()


def run_nccl(replicas, sizes, reps, results):
    import psflow.collective as coll

    gpus = 0
    if coll.nccl_available():
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    for n in replicas:
        if gpus < n:
            emit(
                case=f"nccl/n{n}",
                metric="skipped",
                reason=f"needs CuPy with NCCL and {n} GPUs, found {gpus}",
            )
            continue
        import cupy

        ops = coll.NcclAllReduce()
        for label in sizes:
            size = SIZES[label]
            xs = []
            for r in range(n):
                with cupy.cuda.Device(r):
                    xs.append([cupy.random.standard_normal(size, dtype=cupy.float32)])
            fns = {"nccl": lambda xs=xs, ops=ops: ops.all_reduce(xs)}
            times = time_alternating(fns, reps(label))
            results[("nccl", n, label)] = report("nccl", n, label, size * 4, times["nccl"])


# -- TensorFlow, in a subprocess per replica count ---------------------------------------------
def tf_worker(replicas, sizes, reps, variants):
    """Runs in a subprocess: TF's all-reduce on N logical CPU devices; prints JSON lines.

    The CPU is split into max(replicas) logical devices; run with one replica count.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(max(replicas))]
    )
    all_devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    impl = tf.distribute.experimental.CommunicationImplementation
    opts = tf.distribute.experimental.CommunicationOptions(implementation=impl.RING)
    makers = {
        "tf_collective_ring": lambda d: tf.distribute.MirroredStrategy(d),
        "tf_reduce_to_one": lambda d: tf.distribute.MirroredStrategy(
            d, cross_device_ops=tf.distribute.ReductionToOneDevice()
        ),
        "tf_hierarchical_copy": lambda d: tf.distribute.MirroredStrategy(
            d, cross_device_ops=tf.distribute.HierarchicalCopyAllReduce()
        ),
    }

    def reduce_fn(x):
        return tf.distribute.get_replica_context().all_reduce("sum", x, options=opts)

    for n in replicas:
        # One strategy per variant for all sizes: a second strategy on the same devices
        # would reuse the first one's collective instance keys with other shapes.
        strategies = {name: makers[name](all_devices[:n]) for name in variants}
        for label in sizes:
            size = SIZES[label]
            log(f"tensorflow: n={n} size={label} ...")
            fns = {}
            keep = []
            for name, strategy in strategies.items():
                values = strategy.experimental_distribute_values_from_function(
                    lambda ctx, size=size: tf.random.stateless_normal(
                        [size], seed=[ctx.replica_id_in_sync_group, 1]
                    )
                )
                step = tf.function(lambda v, s=strategy: s.run(reduce_fn, args=(v,)))
                step(values)  # trace
                keep.append((values, step))
                fns[name] = lambda step=step, values=values: step(values)
            a = np.random.default_rng(0).random(size, dtype=np.float32)
            b = np.empty_like(a)
            fns["numpy_copy"] = lambda a=a, b=b: np.copyto(b, a)
            times = time_alternating(fns, reps)
            for name, secs in times.items():
                case = "tf_process_numpy_copy" if name == "numpy_copy" else name
                report(case, n, label, size * 4, secs)
            del keep, fns
    emit(case="tf_version", metric="info", value=tf.__version__)


def run_tf(replicas, sizes, reps, variants, results, timeout):
    """One TF subprocess per replica count (TF's collective keys are per process, and
    two strategies on different device sets in one process collide)."""
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        emit(case="tensorflow", metric="skipped", reason="tensorflow is not installed")
        return
    deadline = time.monotonic() + timeout
    for n in replicas:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            emit(case=f"tensorflow/n{n}", metric="skipped", reason=f"over {timeout}s budget")
            continue
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--tf-worker",
            "--replicas",
            str(n),
            "--sizes",
            ",".join(sizes),
            "--reps",
            str(reps),
            "--tf-variants",
            ",".join(variants),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            emit(case=f"tensorflow/n{n}", metric="skipped", reason=f"over {timeout}s budget")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for line in err.splitlines():
            if line.startswith("tensorflow:"):
                log(line)
        if proc.returncode not in (0, -9):
            tail = err.strip().splitlines()[-1:] or [""]
            emit(
                case=f"tensorflow/n{n}",
                metric="skipped",
                reason=f"exit {proc.returncode}: {tail[0][:200]}",
            )
        for line in out.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            print(line, flush=True)
            if rec.get("metric") == "algbw":
                name, nn, label = rec["case"].split("/")
                results[(name, int(nn[1:]), label)] = rec["value"]


def ratios_vs_tf(results, replicas, sizes):
    """psflow / TF ratios, raw and normalised by each process's own NumPy copy
    bandwidth (the two sides run at different moments of a shared machine)."""
    for n in replicas:
        for label in sizes:
            our_copy = results.get(("numpy_copy", n, label))
            tf_copy = results.get(("tf_process_numpy_copy", n, label))
            for tf_name in ("tf_collective_ring", "tf_reduce_to_one"):
                theirs = results.get((tf_name, n, label))
                if not theirs:
                    continue
                for name in ("ring", "ring/inplace", "reduce_to_one"):
                    ours = results.get((name, n, label))
                    if not ours:
                        continue
                    fields = dict(
                        case=f"{name}/n{n}/{label}",
                        metric="ratio",
                        value=round(ours / theirs, 3),
                        baseline=tf_name,
                        compared=f"psflow {name} algbw / TF {tf_name} algbw",
                    )
                    if our_copy and tf_copy:
                        fields["copy_normalized"] = round((ours / our_copy) / (theirs / tf_copy), 3)
                    emit(**fields)


def table(results, replicas, sizes):
    cols = [
        "numpy_copy",
        "ring",
        "ring/inplace",
        "reduce_to_one",
        "tf_collective_ring",
        "tf_reduce_to_one",
        "tf_hierarchical_copy",
        "tf_process_numpy_copy",
    ]
    cols = [c for c in cols if any((c, n, s) in results for n in replicas for s in sizes)]
    log("")
    log("algbw GB/s (S/t)  " + " ".join(f"{c[:14]:>14}" for c in cols))
    for n in replicas:
        for s in sizes:
            cells = [results.get((c, n, s)) for c in cols]
            row = " ".join(f"{v:14.2f}" if v else f"{'-':>14}" for v in cells)
            log(f"n={n} {s:>4}          {row}")


def _set_madvise_hugepage(enabled):
    try:
        from numpy._core import multiarray
    except ImportError:  # NumPy < 2
        from numpy.core import multiarray
    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    if setter is not None:
        setter(enabled)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    p.add_argument("--no-tf", action="store_true", help="skip the TensorFlow side")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--replicas", default="2,4,8")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--tf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tf-variants", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            p.error(f"unknown size {s!r}; choose from {list(SIZES)}")
    replicas = [int(n) for n in args.replicas.split(",") if n]
    if args.tf_worker:
        _set_madvise_hugepage(False)
        tf_worker(replicas, sizes, args.reps or 3, args.tf_variants.split(","))
        return 0
    if args.reps:
        reps = lambda label: args.reps  # noqa: E731
    elif args.quick:  # the 64M cases dominate: time them once after the warm-up
        reps = {"1M": 3, "16M": 2, "64M": 1}.get
    else:
        reps = {"1M": 15, "16M": 7, "64M": 5}.get
    variants = ["tf_collective_ring", "tf_reduce_to_one"]
    if not args.quick:
        variants.append("tf_hierarchical_copy")
    # NumPy asks for transparent huge pages on large arrays; on VMs where the kernel
    # compacts memory to find them, first touch costs 3-4x.  Only setup time is
    # affected (the measured calls reuse their memory), so turn it off to save time.
    _set_madvise_hugepage(False)
    results = {}
    t0 = time.monotonic()
    run_psflow(replicas, sizes, reps, results)
    run_nccl(replicas, sizes, reps, results)
    if args.no_tf:
        emit(case="tensorflow", metric="skipped", reason="--no-tf")
    else:
        tf_sizes = sizes
        if args.quick:  # TF's ring takes seconds per call at 64M x 8: keep the 16M case
            tf_sizes = ["16M"] if "16M" in sizes else sizes[:1]
            for label in sizes:
                if label not in tf_sizes:
                    emit(case=f"tensorflow/{label}", metric="skipped", reason="--quick")
        run_tf(
            replicas,
            tf_sizes,
            1 if args.quick else args.reps or 3,
            variants,
            results,
            # --quick stays under a minute: TF gets what is left of it
            timeout=max(20.0, 58.0 - (time.monotonic() - t0)) if args.quick else 1200,
        )
        ratios_vs_tf(results, replicas, sizes)
    table(results, replicas, sizes)
    log(f"done in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
