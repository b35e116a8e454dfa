"""psflow's metrics on ``prometheus-client``: bounded label sets, scrape-time collectors.

The ecosystem's library does the counting, the histograms, the exposition
format and the process metrics (``process_cpu_seconds_total``,
``process_resident_memory_bytes``...); this module adds only what psflow's
servers need on top of it:

* **bounded cardinality**: label values come from callers (client ids,
  variable names), so a value longer than :data:`MAX_LABEL_CHARS` is cut, and
  past ``max_series`` label combinations per metric new ones are counted under
  one series whose labels all read ``"other"`` — no caller can grow a server's
  memory through label values;
* **typed errors**: misuse raises :class:`~psflow.errors.InvalidArgumentError`;
* **collectors** that report :class:`Family` values another object already
  counts, evaluated at scrape time.

Example:
    >>> reg = Registry(process_metrics=False)
    >>> pushes = reg.counter("demo_pushes_total", "Pushes.", ["variable"])
    >>> pushes.labels(variable="w").inc()
    >>> parse_exposition(reg.exposition())[("demo_pushes_total", (("variable", "w"),))]
    1.0
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import prometheus_client
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from psflow.errors import InvalidArgumentError

__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "Counter",
    "Family",
    "Gauge",
    "Histogram",
    "Registry",
    "parse_exposition",
]

# generate_latest writes the text format 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
"""Seconds: 100 µs (a loopback round trip) to 30 s (a long closure)."""

OVERFLOW = "other"
# A longer label value is cut, so no caller can make one series arbitrarily large.
MAX_LABEL_CHARS = 128


def _bounded(value: str) -> str:
    if len(value) <= MAX_LABEL_CHARS:
        return value
    return f"{value[: MAX_LABEL_CHARS - 16]}...({len(value)} chars)"


def _check_name(name: str) -> None:
    ok = name and (name[0].isalpha() or name[0] in "_:")
    if not ok or not all(c.isalnum() or c in "_:" for c in name):
        raise InvalidArgumentError(f"invalid metric or label name {name!r}")


def _one_line(help: str) -> str:
    # a HELP line is one line; prometheus-client would keep a newline as "\n"
    return " ".join(help.split("\n"))


@dataclasses.dataclass
class Family:
    """One metric family reported by a collector: its samples are ``(name, labels, value)``."""

    name: str
    type: str
    help: str
    samples: list[tuple[str, dict[str, str], float]] = dataclasses.field(default_factory=list)

    def to_metric(self) -> Metric:
        """The family as a ``prometheus_client`` metric."""
        name = self.name
        if self.type == "counter" and name.endswith("_total"):
            # prometheus-client names a counter family without the suffix its samples carry
            name = name[: -len("_total")]
        metric = Metric(name, _one_line(self.help), self.type)
        for name, labels, value in self.samples:
            metric.add_sample(name, {k: _bounded(str(v)) for k, v in labels.items()}, value)
        return metric


class _GaugeChild:
    """A gauge series with ``set_max`` (prometheus-client has no compare-and-set)."""

    __slots__ = ("_child", "_high", "_lock")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._lock = threading.Lock()
        self._high: float | None = None

    def inc(self, amount: float = 1.0) -> None:
        """Adds ``amount`` (may be negative)."""
        self._child.inc(amount)

    def set(self, value: float) -> None:
        """Sets the value."""
        with self._lock:
            self._high = None
            self._child.set(value)

    def set_max(self, value: float) -> None:
        """Raises the value to ``value`` if that is larger than the last ``set_max``."""
        with self._lock:
            if self._high is None or value > self._high:
                self._high = value
                self._child.set(value)


class _Metric:
    """A prometheus-client metric behind a bounded, cached ``labels()``."""

    def __init__(self, metric: Any, name: str, labelnames: Sequence[str], max_series: int) -> None:
        self.name = name
        self.labelnames = tuple(labelnames)
        self.max_series = max_series
        self._metric = metric
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], Any] = {}

    def _wrap(self, child: Any) -> Any:
        return child

    def labels(self, *values: str, **named: str) -> Any:
        """The series for these label values (created on first use)."""
        if named:
            if values:
                raise InvalidArgumentError("give label values by position or by name, not both")
            try:
                values = tuple(named[n] for n in self.labelnames)
            except KeyError:
                raise InvalidArgumentError(
                    f"{self.name} needs labels {list(self.labelnames)}, got {sorted(named)}"
                ) from None
        # the hot path: one dict lookup for a series already seen
        child = self._children.get(values)
        if child is not None:
            return child
        if len(values) != len(self.labelnames):
            raise InvalidArgumentError(
                f"{self.name} needs {len(self.labelnames)} label values, got {len(values)}"
            )
        key = tuple(_bounded(str(v)) for v in values)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                if len(self._children) >= self.max_series:
                    key = (OVERFLOW,) * len(self.labelnames)
                    child = self._children.get(key)
                if child is None:
                    inner = self._metric.labels(*key) if self.labelnames else self._metric
                    child = self._wrap(inner)
                    self._children[key] = child
            return child

    def remove(self, *values: str) -> bool:
        """Drops the series of these label values; returns whether it existed."""
        key = tuple(_bounded(str(v)) for v in values)
        with self._lock:
            existed = self._children.pop(key, None) is not None
            if existed:
                self._metric.remove(*key)
            return existed


class Counter(_Metric):
    """A monotonically increasing count; ``labels(...).inc(n)``."""

    def inc(self, amount: float = 1.0) -> None:
        """Adds to the unlabelled series.

        Raises:
            InvalidArgumentError: ``amount`` is negative.
        """
        if amount < 0:
            raise InvalidArgumentError(f"a counter cannot decrease (inc({amount}))")
        self.labels().inc(amount)


class Gauge(_Metric):
    """A value that goes up and down; ``labels(...).set(v)``."""

    def _wrap(self, child: Any) -> _GaugeChild:
        return _GaugeChild(child)

    def inc(self, amount: float = 1.0) -> None:
        """Adds ``amount`` (may be negative) to the unlabelled series."""
        self.labels().inc(amount)

    def set(self, value: float) -> None:
        """Sets the unlabelled series."""
        self.labels().set(value)


class Histogram(_Metric):
    """Observations counted into cumulative buckets; ``labels(...).observe(v)``."""

    def observe(self, value: float) -> None:
        """Observes into the unlabelled series."""
        self.labels().observe(value)


class _Collectors:
    """The scrape-time :class:`Family` reporters, as one prometheus-client collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._functions: list[Callable[[], Iterable[Family]]] = []

    def add(self, collect: Callable[[], Iterable[Family]]) -> None:
        with self._lock:
            self._functions.append(collect)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            functions = list(self._functions)
        for collect in functions:
            for family in collect():
                yield family.to_metric()


class Registry:
    """The metrics of one process, rendered by :meth:`exposition`.

    Args:
        max_series: label combinations kept per metric (see the module doc).
        process_metrics: also report this process's CPU, memory and file
            descriptors (prometheus-client's ``process_*`` metrics).
    """

    def __init__(self, max_series: int = 10_000, *, process_metrics: bool = True) -> None:
        self.max_series = max_series
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self._collectors = _Collectors()
        self.registry.register(self._collectors)
        if process_metrics:
            prometheus_client.ProcessCollector(registry=self.registry)

    def _add(
        self, cls: type[_Metric], kind: Any, name: str, help: str, labels: Sequence[str], **kw: Any
    ) -> Any:
        _check_name(name)
        for label in labels:
            _check_name(label)
        try:
            metric = kind(name, _one_line(help), list(labels), registry=self.registry, **kw)
        except ValueError as e:  # a duplicate name; prometheus-client's check, kept typed
            raise InvalidArgumentError(f"metric {name!r} is registered twice ({e})") from None
        return cls(metric, name, labels, self.max_series)

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        """Registers a counter (name it ``..._total``).

        Raises:
            InvalidArgumentError: a bad name, or one already registered.
        """
        return self._add(Counter, prometheus_client.Counter, name, help, labels)

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        """Registers a gauge.

        Raises:
            InvalidArgumentError: a bad name, or one already registered.
        """
        return self._add(Gauge, prometheus_client.Gauge, name, help, labels)

    def histogram(
        self,
        name: str,
        help: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        """Registers a histogram.

        Raises:
            InvalidArgumentError: a bad name, one already registered, or buckets
                that do not increase.
        """
        bounds = [float(b) for b in buckets if b != float("inf")]
        if bounds != sorted(set(bounds)):
            raise InvalidArgumentError(f"buckets of {name} must increase: {list(buckets)}")
        return self._add(Histogram, prometheus_client.Histogram, name, help, labels, buckets=bounds)

    def add_collector(self, collect: Callable[[], Iterable[Family]]) -> None:
        """Adds a function called at every scrape for extra families."""
        self._collectors.add(collect)

    def exposition(self) -> str:
        """Everything in the Prometheus text format."""
        return prometheus_client.generate_latest(self.registry).decode("utf-8")


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a text exposition: ``{(name, sorted label pairs): value}`` (for tests, tools).

    Example:
        >>> parse_exposition('a_total{x="1"} 3\\nb 2.5\\n')
        {('a_total', (('x', '1'),)): 3.0, ('b', ()): 2.5}

    Raises:
        InvalidArgumentError: the text is not in the exposition format.
    """
    samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    except (ValueError, IndexError, KeyError) as e:
        raise InvalidArgumentError(f"not a metrics exposition ({e})") from None
    return samples
