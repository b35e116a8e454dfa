"""The closure executor: a plain object that runs closures for coordinator sessions.

Each coordinator session keeps, on this worker, the functions it has sent
(by key) and the resources its closures created (datasets, iterators).
Closures run one at a time, as TensorFlow's workers run them, inside this
worker's parameter-server session so variable handles resolve here.

A worker may outlive many coordinators, and any caller can name a session, so
sessions are bounded: one exists only once it holds a function or a resource,
at most ``max_sessions`` are kept (the least recently used is dropped first:
its coordinator then gets ``function_missing`` / ``missing_resource`` and sends
them again), one unused for ``session_ttl`` seconds is dropped, and a session
id or key longer than :data:`MAX_KEY_CHARS` is refused.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle

from psflow import errors, settings
from psflow.distribute.coordinator import closure as closure_lib
from psflow.distribute.ps import session as session_lib
from psflow.security.limits import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL
from psflow.transport.started import Started, settle

log = logging.getLogger("psflow.worker")

MAX_KEY_CHARS = 1024  # session ids, function and resource keys
MAX_TEXT_CHARS = 64 << 10  # a closure error's message and traceback, each


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
    used: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def empty(self) -> bool:
        return not (self.functions or self.resources)


def _text(value: Any, limit: int = MAX_TEXT_CHARS) -> str:
    """``value`` as text a protobuf string holds: bounded, lone surrogates escaped."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} chars)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as e:  # a __str__ that raises must not take the reply down
        return f"<str() of {type(exc).__name__} failed: {type(e).__name__}>"


def _code(exc: BaseException) -> int:
    """The canonical code of a psflow error; UNKNOWN for anything else or a bogus ``code``."""
    code = getattr(exc, "code", None) if isinstance(exc, errors.OpError) else None
    try:
        return int(errors.Code(code))
    except (TypeError, ValueError):
        return int(errors.Code.UNKNOWN)


def describe(exc: BaseException) -> dict[str, Any]:
    """A closure's exception as ``ClosureError`` fields, whatever the exception does.

    An exception whose ``__str__`` raises, whose message holds lone surrogates
    or whose ``code`` is not a :class:`~psflow.errors.Code` still gives a
    reply (the worker's own failure would otherwise be the caller's UNKNOWN).
    """
    try:
        fields = closure_lib.describe_error(exc)
    except Exception:
        try:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        except Exception:
            tb = ""
        fields = {"type": type(exc).__name__, "message": _safe_str(exc), "traceback": tb}
        fields["pickled"] = b""
    fields["code"] = _code(exc)
    for key in ("type", "message", "traceback"):
        fields[key] = _text(fields.get(key, ""))
    return fields


class ClosureExecutor:
    """Runs closures; ``strategy_factory`` builds this worker's strategy on first use.

    Args:
        task: this worker's task name, e.g. ``"worker:1"``.
        strategy_factory: returns the ParameterServerStrategy (worker role)
            whose session closures run in; called once, lazily, so a worker can
            start before the parameter servers.
        push_behind: in async mode, let the next closure start while this
            one's pushes are on the wire; its reply still waits for them (see
            ``psflow.distribute.ps.push_behind``).  None: ``PSFLOW_PUSH_BEHIND``
            (on unless ``0``/``off``).
    """

    def __init__(
        self,
        task: str,
        strategy_factory: Callable[[], Any],
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        session_ttl: float = DEFAULT_SESSION_TTL,
        push_behind: bool | None = None,
    ) -> None:
        self.task = task
        # async closures end while their pushes are on the wire (PSFLOW_PUSH_BEHIND)
        self.push_behind = settings.current().push_behind if push_behind is None else push_behind
        self._factory = strategy_factory
        self._strategy: Any = None
        self.max_sessions = max_sessions
        self.session_ttl = session_ttl
        self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._run_lock = threading.Lock()
        self.closures_run = 0
        self.closures_failed = 0
        self._last_end = float("-inf")  # when the last closure left the run lock
        self.started_at = time.time()

    def _ps_session(self) -> session_lib.PSSession:
        if self._strategy is None:
            self._strategy = self._factory()
        return self._strategy._session

    def session_ids(self) -> list[str]:
        """Sessions with state here."""
        with self._lock:
            self._expire()
            return sorted(self._sessions)

    def _expire(self) -> None:
        """Drops sessions unused for ``session_ttl`` (lock held; oldest first)."""
        cutoff = time.monotonic() - self.session_ttl
        while self._sessions:
            sid, state = next(iter(self._sessions.items()))
            if state.used > cutoff:
                break
            del self._sessions[sid]
            log.info("session %.64r unused for %.0fs: dropped", sid, self.session_ttl)

    def _session(self, session_id: str) -> _Session:
        """The session's state; a new one is kept only once it holds something."""
        with self._lock:
            self._expire()
            state = self._sessions.get(session_id)
            if state is None:
                return _Session()
            state.used = time.monotonic()
            self._sessions.move_to_end(session_id)
            return state

    def _keep(self, session_id: str, state: _Session) -> None:
        """Keeps a session that now holds something, dropping the least recently used."""
        if state.empty:
            return
        with self._lock:
            existing = self._sessions.get(session_id)
            if existing is not None and existing is not state:  # a concurrent first use
                existing.functions.update(state.functions)
                existing.resources.update(state.resources)
                state = existing
            state.used = time.monotonic()
            self._sessions[session_id] = state
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                sid, _ = self._sessions.popitem(last=False)
                log.info("more than %d sessions: dropped %.64r", self.max_sessions, sid)

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
        training: session_lib.TrainingMode | None = None,
    ) -> Outcome:
        """Runs one closure and describes how it ended (never raises for the closure's errors).

        ``training`` is the chief's training mode, applied to this worker's
        pushes before the closure runs (None: the mode stays as it is).

        Raises:
            InvalidArgumentError: a session id or key longer than :data:`MAX_KEY_CHARS`.
        """
        for what, key in (
            ("session_id", session_id),
            ("function_key", function_key),
            ("resource_key", resource_key),
        ):
            if len(key) > MAX_KEY_CHARS:
                raise errors.InvalidArgumentError(
                    f"{what} of {len(key)} characters (starting {key[:32]!r}) is above the "
                    f"limit of {MAX_KEY_CHARS}"
                )
        state = self._session(session_id)
        try:
            return self._run(state, session_id, function_key, function, arguments,
                             resource_key, step, closure_id, training)  # fmt: skip
        finally:
            self._keep(session_id, state)

    def _run(
        self,
        state: _Session,
        session_id: str,
        function_key: str,
        function: bytes,
        arguments: bytes,
        resource_key: str,
        step: int,
        closure_id: int,
        training: session_lib.TrainingMode | None,
    ) -> Outcome:
        arrived = time.monotonic()
        with self._run_lock:
            start = time.monotonic()
            # it waited while the closure before ran: it may start from what that one
            # pulled ahead for it (nothing else ran on this worker in between)
            followed = arrived < self._last_end
            outcome, pushes = self._run_one(state, session_id, function_key, function,
                                            arguments, resource_key, step, closure_id,
                                            training, followed)  # fmt: skip
            self._last_end = time.monotonic()
        # the next closure computes while this one's pushes are on the wire; this one
        # is done (and says so) only once they are applied
        if pushes is not None:
            try:
                pushes.result()
            except BaseException as e:
                self.closures_failed += 1
                error = describe(e)
                log.info("closure %.64r: its push failed: %s: %.200s", function_key,
                         error["type"], error["message"])  # fmt: skip
                return Outcome(error=error, run_seconds=time.monotonic() - start)
            self.closures_run += 1
            outcome.run_seconds = time.monotonic() - start
        return outcome

    def _run_one(
        self,
        state: _Session,
        session_id: str,
        function_key: str,
        function: bytes,
        arguments: bytes,
        resource_key: str,
        step: int,
        closure_id: int,
        training: session_lib.TrainingMode | None,
        followed: bool = False,
    ) -> tuple[Outcome, Started | None]:
        """Runs the closure (run lock held); its pushes still in flight come back too."""
        start = time.monotonic()
        ps = self._ps_session()
        if training is not None:  # one closure at a time: the mode is this closure's
            self._strategy._adopt_training_mode(training.sync, training.compression)
        with session_lib.using(ps), closure_lib.resolving(state.resources):
            fn = state.functions.get(function_key)
            if fn is None:
                if not function:
                    return Outcome(function_missing=True), None
                try:
                    fn = cloudpickle.loads(function)
                except BaseException as e:  # unpickling runs the sender's code
                    self.closures_failed += 1
                    return Outcome(error=describe(e)), None
                if not function_key.startswith("once-"):
                    state.functions[function_key] = fn
            try:
                args, kwargs = cloudpickle.loads(arguments) if arguments else ((), {})
            except closure_lib.MissingResourceError as e:
                return Outcome(missing_resource=e.key), None
            except BaseException as e:
                self.closures_failed += 1
                return Outcome(error=describe(e)), None
            pushes = None
            try:
                key = f"{session_id}/c{closure_id}" if closure_id else None
                # a one-off function's reads tell nothing about later steps; a key names
                # a function only within its coordinator session (each numbers its own)
                scope = None if function_key.startswith("once-") else f"{session_id}/{function_key}"
                with ps.step(step or None, key, scope, push_behind=self.push_behind,
                             pull_ahead=followed):  # fmt: skip
                    value = fn(*args, **kwargs)
                    if self.push_behind:
                        pushes = ps.detach_pushes()
                if resource_key:
                    state.resources[resource_key] = value
                    payload = b""
                else:
                    payload = cloudpickle.dumps(value)
            except closure_lib.MissingResourceError as e:
                _settle(pushes)
                return Outcome(missing_resource=e.key), None
            except BaseException as e:  # sys.exit() and KeyboardInterrupt included:
                # raised by the closure, they end the closure, never this worker
                _settle(pushes)
                self.closures_failed += 1
                error = describe(e)
                log.info("closure %.64r raised %s: %.200s", function_key, error["type"],
                         error["message"])  # fmt: skip
                return Outcome(error=error, run_seconds=time.monotonic() - start), None
        if pushes is None:
            self.closures_run += 1
        return Outcome(result=payload, run_seconds=time.monotonic() - start), pushes


def _settle(pushes: Started | None) -> None:
    """Lets a failed closure's pushes in flight end before it says how it failed."""
    if pushes is not None:
        settle([pushes])
