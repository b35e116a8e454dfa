"""Prometheus metrics of a PS task's dynamic tables, read at scrape time.

``psflow_ps_table_rows{task,table,tier}`` (tier ``memory`` or ``disk``),
``psflow_ps_table_hits_total{task,table,tier}`` (looked-up or pushed rows
found in memory, or brought in from disk), ``psflow_ps_table_disk_io_bytes_total
{task,table,direction}`` (``read`` or ``written``) and
``psflow_ps_table_disk_bytes{task,table}`` (the store's size).  A table
without a disk tier reports its rows as memory rows and no disk series.

Example:
    >>> import numpy as np
    >>> from psflow.ps.dynamic_table import TableConfig
    >>> from psflow.ps.tables import TableRegistry
    >>> reg = TableRegistry("ps:0")
    >>> _ = reg.create(TableConfig("t", dim=2), 0, 1)
    >>> _ = reg.lookup("t", np.array([1, 2], np.int64))
    >>> [(f.name, f.samples[0][2]) for f in table_families("ps:0", reg)][0]
    ('psflow_ps_table_rows', 2)
"""

from __future__ import annotations

from psflow.observability.metrics import Family, Registry

from .tables import TableRegistry

__all__ = ["table_families", "watch_tables"]


def table_families(task: str, tables: TableRegistry) -> list[Family]:
    """The tables' families now (cheap: no flush, no eviction scan; the disk rows
    may lag by the writes still queued)."""
    rows = Family("psflow_ps_table_rows", "gauge", "Rows of a table shard, by tier.")
    hits = Family(
        "psflow_ps_table_hits_total",
        "counter",
        "Looked-up or pushed rows found in memory, or brought in from disk.",
    )
    io = Family(
        "psflow_ps_table_disk_io_bytes_total",
        "counter",
        "Bytes of row records the disk tier read or wrote.",
    )
    size = Family("psflow_ps_table_disk_bytes", "gauge", "Bytes of the disk tier's store.")
    for name, gauges in sorted(tables.tier_gauges().items()):
        labels = {"task": task, "table": name}
        rows.samples.append(
            ("psflow_ps_table_rows", {**labels, "tier": "memory"}, gauges["memory_rows"])
        )
        if "disk_rows" not in gauges:
            continue
        rows.samples.append(
            ("psflow_ps_table_rows", {**labels, "tier": "disk"}, gauges["disk_rows"])
        )
        for tier in ("memory", "disk"):
            hits.samples.append(
                ("psflow_ps_table_hits_total", {**labels, "tier": tier}, gauges[f"{tier}_hits"])
            )
        for direction in ("read", "written"):
            io.samples.append(
                (
                    "psflow_ps_table_disk_io_bytes_total",
                    {**labels, "direction": direction},
                    gauges[f"disk_bytes_{direction}"],
                )
            )
        size.samples.append(("psflow_ps_table_disk_bytes", labels, gauges["disk_bytes"]))
    return [f for f in (rows, hits, io, size) if f.samples]


def watch_tables(registry: Registry, task: str, tables: TableRegistry) -> None:
    """Reports ``tables``' families in ``registry`` at every scrape."""
    registry.add_collector(lambda: table_families(task, tables))
