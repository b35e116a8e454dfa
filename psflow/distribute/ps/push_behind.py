"""Pushes behind the compute: a step's gradients in flight while the worker computes on.

In async mode a worker's push does not have to be applied before its next
forward pass starts: TensorFlow's asynchronous training already lets every
gradient meet parameters other workers changed since it was computed.  So a
step's ``apply_gradients`` hands its push (encoding, the shared-memory or
data-plane send, waiting for the reply) to one thread of the session and
returns; the step ends; the worker starts the next closure while the push is
on the wire and the parameter servers apply it.  A worker does so with
``PSFLOW_PUSH_BEHIND=on`` (off by default: on one busy host it measured no
faster, and the extra step of staleness is the user's choice to make).

What that costs, and what it keeps:

* **Staleness: at most one step of the worker's own.**  The next step's
  first read may pull values without this step's update (its gradients carry
  the versions they read as base versions, so the parameter servers count it).
  Pushes run one at a time, in step order, on a single thread, so a step never
  reads values that miss more than the one step before it.
* **Exactly once, and errors, as before.**  The push ids are taken when the
  step pushes (the closure's own ids), and the closure's reply waits for its
  pushes (:meth:`PushesBehind.detach`): a closure is reported done only once
  its gradients are applied, and a failed push is that closure's error (the
  coordinator re-runs or raises it as before; the re-run carries the same ids).
* **Within one step nothing changes.**  A read, write or row lookup of a
  variable whose push is still in flight waits for it first
  (:meth:`PushesBehind.touches`), so a step that reads its weights after
  ``apply_gradients`` sees its update.

**Pulls ahead.**  A step that pushes behind also queues, right after its
first read, a pull of what it read for the step after it (on the same thread:
after the previous step's push, before its own).  The next closure, when it
runs the same function and was already waiting on the worker while this one
ran, starts from those values instead of pulling: its pull was on the wire
while this step computed.  Its values then lack this step's update and no
other: the same one step of staleness as above, never more.

Sync and bounded-staleness steps never push behind: their pushes wait as
before (a sync step waits at the barrier, a bounded one is counted by the
coordinator when its closure ends).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable
from typing import Any

from psflow.transport.started import Started, gather

__all__ = ["PushesBehind"]


class PushesBehind:
    """The pushes a session's current step has in flight, run one at a time on a thread.

    Args:
        task: the session's task, naming the thread.
    """

    def __init__(self, task: str) -> None:
        self._task = task
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[tuple[frozenset[str], concurrent.futures.Future]] = []

    def _thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:  # lock held
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"ps-push-{self._task}"
            )
        return self._executor

    def submit(self, keys: Iterable[str], push: Callable[[], Any]) -> None:
        """Runs ``push()`` after the calls queued before it; ``keys``: what it writes."""
        with self._lock:
            self._pending.append((frozenset(keys), self._thread().submit(push)))

    def queue(self, call: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs ``call()`` after the calls queued before it (no push of the step: nothing
        waits for it but the caller of the future)."""
        with self._lock:
            return self._thread().submit(call)

    @property
    def pending(self) -> bool:
        """Whether the step has pushes not yet waited for."""
        return bool(self._pending)

    def touches(self, key: str) -> bool:
        """Whether a push in flight writes variable ``key``."""
        with self._lock:
            return any(key in keys for keys, _ in self._pending)

    def detach(self) -> Started:
        """Takes the step's pushes out: ``result()`` waits for every one of them.

        Every push runs to its end before the first error (in push order) is
        raised (:func:`~psflow.transport.started.gather`'s rule).
        """
        with self._lock:
            pending, self._pending = self._pending, []
        calls = {i: Started.pooled(future, "Push") for i, (_, future) in enumerate(pending)}

        def wait_all() -> None:
            gather(calls)

        return Started(wait_all, what="Push")

    def wait(self) -> None:
        """Waits for the step's pushes (the first error raised once all ended)."""
        if self._pending:
            self.detach().result()

    def close(self) -> None:
        """Stops the thread once the pushes queued on it ended."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)
