"""psflow.data input pipelines against tf.data, side by side.

Each case iterates one pass of the same pipeline in psflow and in TensorFlow
(when installed), alternating A B A B, and reports examples per second
(examples = rows delivered by the pipeline, batches x batch size) and the
ratio psflow / TensorFlow.

Cases (MNIST-sized data: 60,000 float32 rows of 784 plus int64 labels):
  slices_batch           from_tensor_slices((x, y)).batch(64)
  slices_shuffle_batch   from_tensor_slices((x, y)).shuffle(10000).batch(64)
  slices_repeat_batch    from_tensor_slices((x, y)).shuffle(60000).repeat(2).batch(256)
  map_batch              from_tensor_slices((x, y)).map(scale).batch(64)   (element path)
  range_elements         range(n), element by element

Usage: python benchmarks/bench_data.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

logger = logging.getLogger("bench_data")


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _time_pass(make: Callable[[], Any], budget_s: float) -> tuple[float, int]:
    """Seconds for one full pass over a freshly built pipeline, and examples seen."""
    ds = make()
    start = time.perf_counter()
    examples = 0
    for element in ds:
        first = element[0] if isinstance(element, tuple) else element
        examples += int(first.shape[0]) if len(first.shape) else 1
        if time.perf_counter() - start > budget_s:
            break
    return time.perf_counter() - start, examples


def _cases(
    x: np.ndarray, y: np.ndarray, n_map: int, n_range: int
) -> dict[str, Callable[[Any], Any]]:
    def scale(a: Any, b: Any) -> Any:
        return a * 2.0, b

    return {
        "slices_batch": lambda D: D.from_tensor_slices((x, y)).batch(64),
        "slices_shuffle_batch": lambda D: D.from_tensor_slices((x, y)).shuffle(10000).batch(64),
        "slices_repeat_batch": lambda D: (
            D.from_tensor_slices((x, y)).shuffle(60000).repeat(2).batch(256)
        ),
        "map_batch": lambda D: D.from_tensor_slices((x[:n_map], y[:n_map])).map(scale).batch(64),
        "range_elements": lambda D: D.range(n_range),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, under a minute")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")

    import psflow as pf

    reps = 2 if args.quick else 5
    n_map = 5000 if args.quick else 20000
    n_range = 20000 if args.quick else 100000
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60000, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=60000).astype(np.int64)
    pf.random.set_seed(0)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import tensorflow as tf

        tf.random.set_seed(0)
        tf_version = tf.__version__
    except ImportError:
        tf = None
        tf_version = None
        _emit(
            {
                "bench": "data",
                "case": "all",
                "metric": "skipped",
                "reason": "tensorflow not installed",
            }
        )

    rows = []
    for case, make in _cases(x, y, n_map, n_range).items():
        sides = {"psflow": lambda m=make: m(pf.data.Dataset)}
        if tf is not None:
            sides["tensorflow"] = lambda m=make: m(tf.data.Dataset)
        for fn in sides.values():  # warm up
            _time_pass(fn, 5.0)
        rates: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(reps):  # alternate A B A B
            for name, fn in sides.items():
                secs, examples = _time_pass(fn, 20.0)
                rates[name].append(examples / secs)
        results = {}
        for name, values in rates.items():
            med = statistics.median(values)
            results[name] = med
            record = {
                "bench": "data",
                "case": case,
                "side": name,
                "metric": "throughput",
                "value": round(med, 1),
                "unit": "examples/s",
                "n": reps,
            }
            if name == "tensorflow":
                record["tf_version"] = tf_version
            _emit(record)
        if "tensorflow" in results:
            ratio = results["psflow"] / results["tensorflow"]
            _emit(
                {
                    "bench": "data",
                    "case": case,
                    "metric": "ratio",
                    "value": round(ratio, 3),
                    "a": "psflow",
                    "b": "tensorflow",
                }
            )
        rows.append((case, results.get("psflow"), results.get("tensorflow")))
        logger.info("done %s", case)

    logger.info("%-22s %16s %16s %8s", "case", "psflow ex/s", "tensorflow ex/s", "ratio")
    for case, a, b in rows:
        ratio = f"{a / b:.2f}" if b else "-"
        logger.info("%-22s %16.0f %16s %8s", case, a, f"{b:.0f}" if b else "-", ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
