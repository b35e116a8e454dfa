"""One program over sync-on-read variables, written against ``tf`` (TensorFlow or psflow).

``tests/test_sync_on_read.py`` runs it with psflow and compares with what
TensorFlow 2.21 printed for it; ``tests/test_sync_on_read_tf_reference.py``
runs it under both (when TensorFlow is installed). Errors are recorded as
``"error"``: the frameworks' exception classes differ (ValueError, and
psflow's InvalidArgumentError, which is one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def _value(x: Any) -> Any:
    return np.asarray(x).tolist()


def scenario(tf: Any, strategy: Any) -> dict[str, Any]:
    """Reads and writes in replica and cross-replica context; returns what was seen."""
    out: dict[str, Any] = {}

    def record(key: str, fn: Callable[[], Any]) -> None:
        try:
            out[key] = fn()
        except Exception:
            out[key] = "error"

    def copies(v: Any) -> list[Any]:
        return [_value(c.numpy()) for c in v.values]

    def rid() -> Any:
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    on_read = tf.VariableSynchronization.ON_READ
    for agg in ("SUM", "MEAN", "ONLY_FIRST_REPLICA", "NONE"):
        aggregation = getattr(tf.VariableAggregation, agg)
        with strategy.scope():
            v = tf.Variable([1.0, 2.0], synchronization=on_read, aggregation=aggregation)
        out[f"{agg}/trainable"] = v.trainable
        out[f"{agg}/names"] = [c.name for c in v.values]
        record(f"{agg}/initial", lambda v=v: _value(v.numpy()))

        def step(v: Any = v) -> Any:
            v.assign_add(tf.fill([2], tf.cast(rid(), tf.float32) + 1.0))
            return v.read_value()

        record(
            f"{agg}/run_reads_own_copy",
            lambda step=step: [
                _value(t) for t in strategy.experimental_local_results(strategy.run(step))
            ],
        )
        out[f"{agg}/copies_after_run"] = copies(v)
        record(f"{agg}/read", lambda v=v: _value(v.read_value()))
        record(f"{agg}/arithmetic", lambda v=v: _value(v + 0.0))
        record(f"{agg}/reduce_sum", lambda v=v: _value(strategy.reduce("SUM", v, axis=None)))
        record(
            f"{agg}/assign",
            lambda v=v: (v.assign(tf.constant([10.0, 20.0]), read_value=False), copies(v))[1],
        )
        record(f"{agg}/read_after_assign", lambda v=v: _value(v.numpy()))
        record(
            f"{agg}/assign_add",
            lambda v=v: (v.assign_add(tf.constant([2.0, 2.0]), read_value=False), copies(v))[1],
        )
        record(
            f"{agg}/assign_sub",
            lambda v=v: (v.assign_sub(tf.constant([1.0, 1.0]), read_value=False), copies(v))[1],
        )
        out[f"{agg}/copies_at_end"] = copies(v)
        record(
            f"{agg}/run_assign",
            lambda v=v: (
                strategy.run(lambda: v.assign(tf.constant([3.0, 3.0]), read_value=False)),
                copies(v),
            )[1],
        )

        record(
            f"{agg}/assign_bad_shape",
            lambda v=v: v.assign(tf.constant([1.0, 2.0, 3.0]), read_value=False),
        )
        out[f"{agg}/copies_after_bad_shape"] = copies(v)

    sum_ = tf.VariableAggregation.SUM
    with strategy.scope():
        vi = tf.Variable(0, synchronization=on_read, aggregation=sum_)
    strategy.run(lambda: vi.assign_add(3))
    out["int_sum/read"] = _value(vi.numpy())
    vi.assign(5)
    out["int_sum/assign_5"] = copies(vi)

    def int_mean() -> Any:
        with strategy.scope():
            tf.Variable(0, synchronization=on_read, aggregation=tf.VariableAggregation.MEAN)
        return "created"

    record("int_mean", int_mean)

    def make() -> Any:
        return tf.Variable(1.0, synchronization=on_read, aggregation=sum_)

    with strategy.scope():
        made = strategy.run(make)
    out["created_in_run/copies"] = copies(made)
    out["created_in_run/read"] = _value(made.numpy())
    return out
