"""A small Prometheus metrics registry: counters, gauges, histograms, text exposition.

Only what psflow's servers need, with no dependency: metrics with labels,
thread-safe updates, collectors evaluated at scrape time (for values another
object already counts), and the text exposition format 0.0.4
(https://prometheus.io/docs/instrumenting/exposition_formats/).  The number of
label combinations per metric is capped (``max_series``): past the cap, new
combinations are counted under one series whose labels all read ``"other"``,
so callers cannot grow a server's memory through label values.

Example:
    >>> reg = Registry()
    >>> pushes = reg.counter("demo_pushes_total", "Pushes.", ["variable"])
    >>> pushes.labels(variable="w").inc()
    >>> print(reg.exposition(), end="")
    # HELP demo_pushes_total Pushes.
    # TYPE demo_pushes_total counter
    demo_pushes_total{variable="w"} 1
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from psflow.errors import InvalidArgumentError

__all__ = [
    "LATENCY_BUCKETS",
    "CONTENT_TYPE",
    "Counter",
    "Family",
    "Gauge",
    "Histogram",
    "Registry",
    "parse_exposition",
]

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
# Label values come from callers (client ids, variable names): a longer one is cut,
# so no caller can make one series arbitrarily large.
MAX_LABEL_CHARS = 128


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if isinstance(value, int) or (
        isinstance(value, float) and value.is_integer() and abs(value) < 2**53
    ):
        return str(int(value))
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return repr(float(value))


def _labels_text(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _bounded(value: str) -> str:
    if len(value) <= MAX_LABEL_CHARS:
        return value
    return f"{value[: MAX_LABEL_CHARS - 16]}...({len(value)} chars)"


def _check_name(name: str) -> None:
    ok = name and (name[0].isalpha() or name[0] in "_:")
    if not ok or not all(c.isalnum() or c in "_:" for c in name):
        raise InvalidArgumentError(f"invalid metric or label name {name!r}")


@dataclasses.dataclass
class Family:
    """One metric family as exposed: its samples are ``(name, labels, value)``."""

    name: str
    type: str
    help: str
    samples: list[tuple[str, dict[str, str], float]] = dataclasses.field(default_factory=list)

    def render(self) -> str:
        """The family in the text exposition format."""
        lines = [
            f"# HELP {self.name} {self.help.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}",
            f"# TYPE {self.name} {self.type}",
        ]
        lines += [f"{n}{_labels_text(lbl)} {_format_value(v)}" for n, lbl, v in self.samples]
        return "\n".join(lines) + "\n"


class _Metric:
    type = "untyped"

    def __init__(self, name: str, help: str, labelnames: Sequence[str], max_series: int) -> None:
        _check_name(name)
        for label in labelnames:
            _check_name(label)
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self.max_series = max_series
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], object] = {}

    def _new_child(self) -> object:
        raise NotImplementedError

    def labels(self, *values: str, **named: str):
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
        if len(values) != len(self.labelnames):
            raise InvalidArgumentError(
                f"{self.name} needs {len(self.labelnames)} label values, got {len(values)}"
            )
        key = tuple(_bounded(str(v)) for v in values)
        child = self._children.get(key)
        if child is not None:
            return child
        with self._lock:
            child = self._children.get(key)
            if child is None:
                if len(self._children) >= self.max_series:
                    key = (OVERFLOW,) * len(self.labelnames)
                    child = self._children.get(key)
                if child is None:
                    child = self._new_child()
                    self._children[key] = child
            return child

    def remove(self, *values: str) -> bool:
        """Drops the series of these label values; returns whether it existed."""
        key = tuple(_bounded(str(v)) for v in values)
        with self._lock:
            return self._children.pop(key, None) is not None

    def _series(self) -> list[tuple[dict[str, str], object]]:
        with self._lock:
            items = list(self._children.items())
        return [(dict(zip(self.labelnames, key)), child) for key, child in items]

    def collect(self) -> Family:
        """The current samples."""
        raise NotImplementedError


class _Value:
    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Adds ``amount``."""
        with self._lock:
            self.value += amount

    def set(self, value: float) -> None:
        """Sets the value (gauges)."""
        with self._lock:
            self.value = value

    def set_max(self, value: float) -> None:
        """Raises the value to ``value`` if that is larger (gauges)."""
        with self._lock:
            if value > self.value:
                self.value = value


class Counter(_Metric):
    """A monotonically increasing count; ``labels(...).inc(n)``."""

    type = "counter"

    def _new_child(self) -> _Value:
        return _Value()

    def inc(self, amount: float = 1.0) -> None:
        """Adds to the unlabelled series."""
        if amount < 0:
            raise InvalidArgumentError(f"a counter cannot decrease (inc({amount}))")
        self.labels().inc(amount)

    def collect(self) -> Family:
        """The current samples."""
        family = Family(self.name, self.type, self.help)
        family.samples = [(self.name, lbl, c.value) for lbl, c in self._series()]
        return family


class Gauge(Counter):
    """A value that goes up and down; ``labels(...).set(v)``."""

    type = "gauge"

    def inc(self, amount: float = 1.0) -> None:
        """Adds ``amount`` (may be negative) to the unlabelled series."""
        self.labels().inc(amount)

    def set(self, value: float) -> None:
        """Sets the unlabelled series."""
        self.labels().set(value)


class _Buckets:
    __slots__ = ("_lock", "bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Counts one observation."""
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self.counts[i] += 1
            self.sum += value
            self.count += 1

    def snapshot(self) -> tuple[list[int], float, int]:
        with self._lock:
            return list(self.counts), self.sum, self.count


class Histogram(_Metric):
    """Observations counted into cumulative buckets; ``labels(...).observe(v)``."""

    type = "histogram"

    def __init__(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str],
        max_series: int,
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        super().__init__(name, help, labelnames, max_series)
        bounds = tuple(float(b) for b in buckets if b != math.inf)
        if list(bounds) != sorted(set(bounds)):
            raise InvalidArgumentError(f"buckets of {name} must increase: {list(buckets)}")
        self.bounds = bounds

    def _new_child(self) -> _Buckets:
        return _Buckets(self.bounds)

    def observe(self, value: float) -> None:
        """Observes into the unlabelled series."""
        self.labels().observe(value)

    def collect(self) -> Family:
        """The current samples (``_bucket``, ``_sum``, ``_count``)."""
        family = Family(self.name, self.type, self.help)
        for labels, child in self._series():
            counts, total, count = child.snapshot()
            running = 0
            for bound, n in zip((*self.bounds, math.inf), counts):
                running += n
                family.samples.append(
                    (f"{self.name}_bucket", {**labels, "le": _format_value(bound)}, running)
                )
            family.samples.append((f"{self.name}_sum", labels, total))
            family.samples.append((f"{self.name}_count", labels, count))
        return family


class Registry:
    """The metrics of one process, rendered by :meth:`exposition`.

    Args:
        max_series: label combinations kept per metric (see the module doc).
    """

    def __init__(self, max_series: int = 10_000) -> None:
        self.max_series = max_series
        self._metrics: dict[str, _Metric] = {}
        self._collectors: list[Callable[[], Iterable[Family]]] = []
        self._lock = threading.Lock()

    def _add(self, metric: _Metric) -> _Metric:
        with self._lock:
            if metric.name in self._metrics:
                raise InvalidArgumentError(f"metric {metric.name!r} is registered twice")
            self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        """Registers a counter (name it ``..._total``)."""
        return self._add(Counter(name, help, labels, self.max_series))

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        """Registers a gauge."""
        return self._add(Gauge(name, help, labels, self.max_series))

    def histogram(
        self,
        name: str,
        help: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        """Registers a histogram."""
        return self._add(Histogram(name, help, labels, self.max_series, buckets))

    def add_collector(self, collect: Callable[[], Iterable[Family]]) -> None:
        """Adds a function called at every scrape for extra families."""
        with self._lock:
            self._collectors.append(collect)

    def collect(self) -> list[Family]:
        """Every family, registered metrics first."""
        with self._lock:
            metrics = list(self._metrics.values())
            collectors = list(self._collectors)
        families = [m.collect() for m in metrics]
        for collect in collectors:
            families.extend(collect())
        return families

    def exposition(self) -> str:
        """Everything in the Prometheus text format."""
        return "".join(f.render() for f in self.collect())


def _unescape(value: str) -> str:
    out, i = [], 0
    while i < len(value):
        c = value[i]
        if c == "\\" and i + 1 < len(value):
            nxt = value[i + 1]
            out.append({"n": "\n", "\\": "\\", '"': '"'}.get(nxt, nxt))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _parse_labels(text: str) -> dict[str, str]:
    labels, i = {}, 0
    while i < len(text):
        eq = text.index("=", i)
        key = text[i:eq].strip().lstrip(",").strip()
        if text[eq + 1] != '"':
            raise InvalidArgumentError(f"label {key!r} value is not quoted in {text!r}")
        j = eq + 2
        while text[j] != '"':
            j += 2 if text[j] == "\\" else 1
        labels[key] = _unescape(text[eq + 2 : j])
        i = j + 1
    return labels


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a text exposition: ``{(name, sorted label pairs): value}`` (for tests, tools).

    Example:
        >>> parse_exposition('a_total{x="1"} 3\\nb 2.5\\n')
        {('a_total', (('x', '1'),)): 3.0, ('b', ()): 2.5}

    Raises:
        InvalidArgumentError: a line is not a sample, comment or blank.
    """
    samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if "{" in line:
                name, rest = line.split("{", 1)
                label_text, value = rest.rsplit("}", 1)
                labels = _parse_labels(label_text)
            else:
                name, value = line.split(None, 1)
                labels = {}
            number = float(value.split()[0].replace("+Inf", "inf").replace("-Inf", "-inf"))
        except (ValueError, IndexError) as e:
            raise InvalidArgumentError(f"not a metrics sample: {line!r} ({e})") from None
        samples[(name.strip(), tuple(sorted(labels.items())))] = number
    return samples
