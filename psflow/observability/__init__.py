"""Observability of psflow processes: Prometheus metrics and structured logs.

Modules (imported explicitly; nothing is started on import):

* :mod:`psflow.observability.metrics` — metrics on prometheus-client (counters,
  gauges, histograms, process metrics) with bounded label sets;
* :mod:`psflow.observability.http` — ``MetricsServer``: ``GET /metrics`` on its
  own port, from a daemon thread;
* :mod:`psflow.observability.services` — the metric families of the parameter
  server and the worker;
* :mod:`psflow.observability.logs` — text or JSON log lines carrying role,
  task, step and request id;
* :mod:`psflow.observability.flags` — ``--metrics-port``, ``--metrics-bind``,
  ``--log-format``, ``--log-level``.
"""
