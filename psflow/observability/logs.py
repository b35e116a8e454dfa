"""Process logging: plain text or one JSON object per line, with role, task, step and request id.

Servers set the step and request id of the call they are serving with
:func:`log_context`; every record logged inside (by any logger) carries them.

Example:
    >>> import io, json, logging
    >>> stream = io.StringIO()
    >>> handler = logging.StreamHandler(stream)
    >>> handler.setFormatter(JsonFormatter(role="ps", task="ps:0"))
    >>> logger = logging.getLogger("demo.json")
    >>> logger.addHandler(handler); logger.propagate = False
    >>> with log_context(step=7, request_id="c1:3"):
    ...     logger.warning("slow push")
    >>> record = json.loads(stream.getvalue())
    >>> record["role"], record["task"], record["step"], record["request_id"], record["message"]
    ('ps', 'ps:0', 7, 'c1:3', 'slow push')
"""

from __future__ import annotations

import contextvars
import datetime
import enum
import json
import logging
import sys
from typing import Any, TextIO

from psflow.errors import InvalidArgumentError

__all__ = [
    "LogFormat",
    "JsonFormatter",
    "configure_logging",
    "current_context",
    "log_context",
    "set_log_context",
]

_STEP: contextvars.ContextVar[int | None] = contextvars.ContextVar("psflow_step", default=None)
_REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "psflow_request_id", default=None
)

# Attributes every LogRecord has; anything else came through ``extra=`` and is kept.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class LogFormat(enum.Enum):
    """How a process writes its log lines."""

    TEXT = "text"
    JSON = "json"

    @classmethod
    def parse(cls, value: str | LogFormat) -> LogFormat:
        """The format named ``value``.

        Raises:
            InvalidArgumentError: unknown name (the message lists the choices).
        """
        if isinstance(value, LogFormat):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise InvalidArgumentError(
                f"log format {value!r} is not one of {[f.value for f in cls]}"
            ) from None


class log_context:  # noqa: N801 - used as a function-style context manager
    """Records logged inside carry ``step`` and ``request_id`` (unchanged when None).

    A small class rather than a generator-based context manager: every RPC a
    server handles enters one, and this costs a fraction of the generator's.
    """

    __slots__ = ("_request", "_step", "_tokens")

    def __init__(self, *, step: int | None = None, request_id: str | None = None) -> None:
        self._step = step
        self._request = request_id
        self._tokens: list[tuple[contextvars.ContextVar, contextvars.Token]] = []

    def __enter__(self) -> None:
        # both are set (to their current value when None), so that leaving the block also
        # undoes what :func:`set_log_context` set inside it: nothing leaks to the next call
        step = _STEP.get() if self._step is None else int(self._step)
        request = _REQUEST.get() if self._request is None else str(self._request)
        self._tokens.append((_STEP, _STEP.set(step)))
        self._tokens.append((_REQUEST, _REQUEST.set(request)))

    def __exit__(self, *exc: object) -> None:
        for var, token in reversed(self._tokens):
            var.reset(token)
        self._tokens.clear()


def set_log_context(*, step: int | None = None, request_id: str | None = None) -> None:
    """Sets ``step``/``request_id`` (when not None) until the enclosing :func:`log_context` ends.

    For code that learns them late (a push's id is in its header) and whose
    caller's ``log_context`` block should still log with them, e.g. a rejection.
    """
    if step is not None:
        _STEP.set(int(step))
    if request_id is not None:
        _REQUEST.set(str(request_id))


def current_context() -> dict[str, Any]:
    """The step and request id set by the innermost :func:`log_context` (None when unset)."""
    return {"step": _STEP.get(), "request_id": _REQUEST.get()}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: time, level, logger, message, role, task, step,
    request id, any ``extra=`` fields, and the traceback when there is one.

    Args:
        role: ``"ps"``, ``"worker"`` or ``"chief"``.
        task: ``"ps:0"``...
    """

    def __init__(self, role: str, task: str) -> None:
        super().__init__()
        self.role = role
        self.task = task

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON object on one line."""
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "role": self.role,
            "task": self.task,
            **current_context(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class _TextFormatter(logging.Formatter):
    """The text format, with ``step=`` and ``request=`` when a call set them."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ctx = current_context()
        extra = " ".join(
            f"{k}={v}" for k, v in (("step", ctx["step"]), ("request", ctx["request_id"])) if v
        )
        return f"{line} [{extra}]" if extra else line


def configure_logging(
    role: str,
    task: str,
    level: str | int = "INFO",
    fmt: str | LogFormat = LogFormat.TEXT,
    stream: TextIO | None = None,
) -> None:
    """Sends the root logger's records to ``stream`` (stderr) in ``fmt``; for entry points only.

    Raises:
        InvalidArgumentError: unknown format or level.
    """
    log_format = LogFormat.parse(fmt)
    if isinstance(level, str):
        resolved = logging.getLevelName(level.upper())
        if not isinstance(resolved, int):
            raise InvalidArgumentError(f"unknown log level {level!r}")
        level = resolved
    handler = logging.StreamHandler(stream or sys.stderr)
    if log_format is LogFormat.JSON:
        handler.setFormatter(JsonFormatter(role, task))
    else:
        handler.setFormatter(
            _TextFormatter(
                f"%(asctime)s %(levelname)s role={role} task={task} %(name)s: %(message)s"
            )
        )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
