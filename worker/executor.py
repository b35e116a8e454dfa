"""The closure executor: a plain object that runs closures for coordinator sessions.

Each coordinator session keeps, on this worker, the functions it has sent
(by key) and the resources its closures created (datasets, iterators).
Closures run one at a time, as TensorFlow's workers run them, inside this
worker's parameter-server session so variable handles resolve here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

from psflow.distribute.coordinator import closure as closure_lib
from psflow.distribute.ps import session as session_lib

log = logging.getLogger("psflow.worker")


@dataclasses.dataclass
class Outcome:
    """What one closure run produced (the servicer turns it into a reply)."""

    result: bytes = b""
    error: dict[str, Any] | None = None
    function_missing: bool = False
    missing_resource: str = ""
    run_seconds: float = 0.0


@dataclasses.dataclass
class _Session:
    functions: dict[str, Any] = dataclasses.field(default_factory=dict)
    resources: dict[str, Any] = dataclasses.field(default_factory=dict)


class ClosureExecutor:
    """Runs closures; ``strategy_factory`` builds this worker's strategy on first use.

    Args:
        task: this worker's task name, e.g. ``"worker:1"``.
        strategy_factory: returns the ParameterServerStrategy (worker role)
            whose session closures run in; called once, lazily, so a worker can
            start before the parameter servers.
    """

    def __init__(self, task: str, strategy_factory: Callable[[], Any]) -> None:
        self.task = task
        self._factory = strategy_factory
        self._strategy: Any = None
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._run_lock = threading.Lock()
        self.closures_run = 0
        self.closures_failed = 0
        self.started_at = time.time()

    def _ps_session(self) -> session_lib.PSSession:
        if self._strategy is None:
            self._strategy = self._factory()
        return self._strategy._session

    def session_ids(self) -> list[str]:
        """Sessions with state here."""
        with self._lock:
            return sorted(self._sessions)

    def end_session(self, session_id: str) -> bool:
        """Drops a session's functions and resources; returns whether it existed."""
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def run(
        self,
        session_id: str,
        function_key: str,
        function: bytes,
        arguments: bytes,
        resource_key: str = "",
        step: int = 0,
        closure_id: int = 0,
    ) -> Outcome:
        """Runs one closure and describes how it ended (never raises for the closure's errors)."""
        with self._lock:
            state = self._sessions.setdefault(session_id, _Session())
        with self._run_lock:
            start = time.monotonic()
            ps = self._ps_session()
            with session_lib.using(ps), closure_lib.resolving(state.resources):
                fn = state.functions.get(function_key)
                if fn is None:
                    if not function:
                        return Outcome(function_missing=True)
                    try:
                        fn = cloudpickle.loads(function)
                    except Exception as e:
                        self.closures_failed += 1
                        return Outcome(error=closure_lib.describe_error(e))
                    if not function_key.startswith("once-"):
                        state.functions[function_key] = fn
                try:
                    args, kwargs = cloudpickle.loads(arguments) if arguments else ((), {})
                except closure_lib.MissingResourceError as e:
                    return Outcome(missing_resource=e.key)
                except Exception as e:
                    self.closures_failed += 1
                    return Outcome(error=closure_lib.describe_error(e))
                try:
                    key = f"{session_id}/c{closure_id}" if closure_id else None
                    with ps.step(step or None, key):
                        value = fn(*args, **kwargs)
                    if resource_key:
                        state.resources[resource_key] = value
                        payload = b""
                    else:
                        payload = cloudpickle.dumps(value)
                except closure_lib.MissingResourceError as e:
                    return Outcome(missing_resource=e.key)
                except Exception as e:
                    self.closures_failed += 1
                    log.info("closure %s raised %s: %s", function_key, type(e).__name__, e)
                    return Outcome(
                        error=closure_lib.describe_error(e), run_seconds=time.monotonic() - start
                    )
            self.closures_run += 1
            return Outcome(result=payload, run_seconds=time.monotonic() - start)
