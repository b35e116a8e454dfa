"""The chief's live dashboard: one page and one JSON API (``/api/cluster``) about the whole job.

Modules (imported explicitly; nothing starts on import):

* :mod:`psflow.dashboard.probe` — asks every PS task for its stats (``GetStats``)
  and every worker for its status (``GetStatus``), each call with a deadline;
* :mod:`psflow.dashboard.collector` — turns successive probes into task states
  (ready, running, lost, replaced), rates and events, and builds the
  ``/api/cluster`` document (schema: ``tests/schemas/cluster_api.schema.json``);
* :mod:`psflow.dashboard.server` — ``DashboardServer``: the page, its script and
  the JSON API over HTTP from daemon threads, loopback unless a token guards it;
* :mod:`psflow.dashboard.terminal` — the same document as a compact text table
  (``psflow local --status``);
* :mod:`psflow.dashboard.job_status` — what ``psflow local`` tells the page
  (each process's exit status, the restart policy) and the final document it
  keeps serving once the chief has exited.

Example::

    psflow local --ps 2 --workers 2 --dashboard 8080 examples/keras_digits.py
    # then open http://127.0.0.1:8080/
"""
