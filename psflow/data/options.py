"""Dataset options (TensorFlow's ``tf.data.Options``) and the auto-shard policy.

Options are plain records attached with ``Dataset.with_options``; psflow's own
pipeline reads only a few of them (the distribution strategies read
``experimental_distribute.auto_shard_policy``), but every field a TensorFlow
script commonly sets is accepted, so such scripts run unchanged. Setting an
unknown field raises ``AttributeError`` naming it, as in TensorFlow.

Example:
    >>> import psflow as pf
    >>> options = pf.data.Options()
    >>> options.experimental_distribute.auto_shard_policy = (
    ...     pf.data.experimental.AutoShardPolicy.DATA)
    >>> ds = pf.data.Dataset.range(4).with_options(options)
    >>> ds.options().experimental_distribute.auto_shard_policy.name
    'DATA'
"""

from __future__ import annotations

import enum
from typing import Any


class AutoShardPolicy(enum.IntEnum):
    """How a distribution strategy splits a dataset among workers (TF's values).

    OFF: no sharding, every worker sees every element. AUTO: FILE if the
    pipeline reads files, else DATA. FILE: shard by input file. DATA: every
    worker reads all data and keeps every ``num_workers``-th element. HINT:
    shard where the pipeline calls ``shard(SHARD_HINT, ...)``.
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class _OptionsBase:
    """A record of optional settings: each field is ``None``/default until set.

    Subclasses list their fields in ``_FIELDS`` as ``name -> (default, check)``.
    """

    _FIELDS: dict[str, tuple[Any, Any]] = {}
    _ALIASES: dict[str, str] = {}

    def __init__(self) -> None:
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_frozen", False)
        for name, (default, _check) in self._FIELDS.items():
            if isinstance(default, type) and issubclass(default, _OptionsBase):
                self._values[name] = default()

    def __getattr__(self, name: str) -> Any:
        name = type(self)._ALIASES.get(name, name)
        fields = type(self)._FIELDS
        if name not in fields:
            raise AttributeError(f"{type(self).__name__} has no option {name!r}")
        return self.__dict__.get("_values", {}).get(name, fields[name][0])

    def __setattr__(self, name: str, value: Any) -> None:
        name = type(self)._ALIASES.get(name, name)
        fields = type(self)._FIELDS
        if name not in fields:
            raise AttributeError(
                f"Cannot set the property {name!r} on {type(self).__name__}; "
                f"known: {sorted(fields)}"
            )
        if self._frozen:
            raise ValueError(
                "Options returned by Dataset.options() are read-only; use "
                "Dataset.with_options(options) to set them"
            )
        default, check = fields[name]
        if isinstance(default, type) and issubclass(default, _OptionsBase):
            if not isinstance(value, default):
                raise TypeError(f"Option {name!r} needs a {default.__name__}, got {value!r}")
        elif value is not None and check is not None:
            value = check(name, value)
        self._values[name] = value

    def _is_set(self, name: str) -> bool:
        return name in self._values

    def _merge(self, other: _OptionsBase) -> _OptionsBase:
        """A new record: ``self``'s settings overridden by those ``other`` set."""
        out = type(self)()
        for name, (default, _c) in self._FIELDS.items():
            if isinstance(default, type) and issubclass(default, _OptionsBase):
                out._values[name] = getattr(self, name)._merge(getattr(other, name))
            elif other._is_set(name):
                out._values[name] = other._values[name]
            elif self._is_set(name):
                out._values[name] = self._values[name]
        return out

    def _freeze(self) -> _OptionsBase:
        object.__setattr__(self, "_frozen", True)
        for v in self._values.values():
            if isinstance(v, _OptionsBase):
                v._freeze()
        return self

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n in self._FIELDS
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        parts = [f"{n}={getattr(self, n)!r}" for n in self._FIELDS]
        return f"{type(self).__name__}({', '.join(parts)})"

    def __getstate__(self) -> dict[str, Any]:
        return {"values": self._values, "frozen": self._frozen}

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", state["values"])
        object.__setattr__(self, "_frozen", state["frozen"])


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"Option {name!r} needs a bool, got {value!r}")
    return value


def _nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"Option {name!r} needs an integer >= 0, got {value!r}")
    return value


def _policy(name: str, value: Any) -> AutoShardPolicy:
    try:
        return AutoShardPolicy(value)
    except ValueError:
        raise TypeError(
            f"Option {name!r} needs an AutoShardPolicy "
            f"({[p.name for p in AutoShardPolicy]}), got {value!r}"
        ) from None


class DistributeOptions(_OptionsBase):
    """How a distribution strategy treats the dataset (``auto_shard_policy``, ``num_devices``)."""

    _FIELDS = {
        "auto_shard_policy": (AutoShardPolicy.AUTO, _policy),
        "num_devices": (None, _nonneg_int),
    }


class ThreadingOptions(_OptionsBase):
    """Thread-pool settings (accepted; psflow sizes its own pools)."""

    _FIELDS = {
        "max_intra_op_parallelism": (None, _nonneg_int),
        "private_threadpool_size": (None, _nonneg_int),
    }


class OptimizationOptions(_OptionsBase):
    """Graph-rewrite switches (accepted; psflow's pipeline has no rewriter)."""

    _FIELDS = {
        name: (None, _bool)
        for name in (
            "apply_default_optimizations",
            "filter_fusion",
            "filter_parallelization",
            "inject_prefetch",
            "map_and_batch_fusion",
            "map_and_filter_fusion",
            "map_fusion",
            "map_parallelization",
            "noop_elimination",
            "parallel_batch",
            "shuffle_and_repeat_fusion",
        )
    }


class AutotuneOptions(_OptionsBase):
    """Autotuning settings (accepted; AUTOTUNE picks fixed sizes in psflow)."""

    _FIELDS = {
        "enabled": (None, _bool),
        "cpu_budget": (None, _nonneg_int),
        "ram_budget": (None, _nonneg_int),
        "autotune_algorithm": (None, None),
    }


class Options(_OptionsBase):
    """Options for a dataset pipeline (TensorFlow's ``tf.data.Options``).

    Fields: ``deterministic`` (alias ``experimental_deterministic``),
    ``experimental_distribute`` (:class:`DistributeOptions`), ``threading``
    (alias ``experimental_threading``), ``experimental_optimization``,
    ``autotune``, ``experimental_slack``, ``experimental_external_state_policy``,
    ``experimental_warm_start``, ``experimental_symbolic_checkpoint``.
    psflow's pipeline is always deterministic: ``map(num_parallel_calls=...)``
    and ``prefetch`` keep the input order whatever ``deterministic`` says.
    """

    _FIELDS = {
        "deterministic": (None, _bool),
        "experimental_distribute": (DistributeOptions, None),
        "threading": (ThreadingOptions, None),
        "experimental_optimization": (OptimizationOptions, None),
        "autotune": (AutotuneOptions, None),
        "experimental_slack": (None, _bool),
        "experimental_external_state_policy": (None, None),
        "experimental_warm_start": (None, _bool),
        "experimental_symbolic_checkpoint": (None, _bool),
    }
    _ALIASES = {
        "experimental_deterministic": "deterministic",
        "experimental_threading": "threading",
    }

    def merge(self, other: Options) -> Options:
        """A new ``Options``: this one's settings overridden by those ``other`` set."""
        if not isinstance(other, Options):
            raise TypeError(f"Options.merge needs Options, got {other!r}")
        return self._merge(other)  # type: ignore[return-value]
