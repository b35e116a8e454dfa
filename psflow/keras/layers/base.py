"""The ``Layer`` base class: weights, deferred building, sublayer tracking.

A layer creates its weights in ``build(input_shape)``, which runs on the first
call (or at construction when ``input_shape`` is given). Weights are
``psflow.Variable``s made inside the strategy scope the layer was created in,
so the active strategy decides where they live (in-process, mirrored, or on
parameter servers).
"""

from __future__ import annotations

import inspect
import itertools
import re
import threading
from collections import defaultdict
from typing import Any

import numpy as np

from psflow import backend, dtypes, errors
from psflow.distribute import distribute_lib
from psflow.framework.tensor import Tensor, TensorShape, to_array
from psflow.framework.variable import Variable
from psflow.keras import initializers
from psflow.keras.engine import keras_tensor
from psflow.train import deferred
from psflow.train.trackable import Trackable

_name_lock = threading.Lock()
_track_lock = threading.Lock()  # layers' weight lists, appended to from replica threads
_name_counts: dict[str, itertools.count] = defaultdict(itertools.count)


def unique_name(base: str) -> str:
    """``base``, then ``base_1``, ``base_2``... (Keras's naming of layers)."""
    with _name_lock:
        n = next(_name_counts[base])
    return base if n == 0 else f"{base}_{n}"


def clear_session() -> None:
    """Resets layer-name counters (Keras's ``keras.backend.clear_session``)."""
    with _name_lock:
        _name_counts.clear()


def to_snake(name: str) -> str:
    """``Dense`` -> ``dense``, ``SimpleRNN`` -> ``simple_rnn``."""
    s = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", s).lower()


_CALL_TAKES_TRAINING: dict[type, bool] = {}


def _takes_training(cls: type) -> bool:
    found = _CALL_TAKES_TRAINING.get(cls)
    if found is None:
        params = inspect.signature(cls.call).parameters
        found = "training" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        _CALL_TAKES_TRAINING[cls] = found
    return found


class Layer(Trackable):
    """Base class of layers (Keras's ``keras.layers.Layer``).

    A checkpoint tracks a layer through its children: its weights by the names
    they were made with, and its public attributes that hold layers, variables,
    optimizers or iterators (see :mod:`psflow.train.object_graph`); a layer
    builds them later, so their values wait for it (``checkpoint_grows``).

    Args:
        trainable: whether the layer's weights are trained.
        name: a name; unique names are generated per class otherwise.
        dtype: the dtype of the weights (float32).
        input_shape: the shape of one example, so the layer builds at once.
    """

    def __init__(
        self,
        trainable: bool = True,
        name: str | None = None,
        dtype: Any = None,
        input_shape: Any = None,
        input_dim: int | None = None,
        batch_input_shape: Any = None,
        **kwargs: Any,
    ) -> None:
        unknown = set(kwargs) - {
            "autocast",
            "dynamic",
            "input_length",
            "weights",
            "activity_regularizer",
        }
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword arguments {sorted(unknown)}"
            )
        self.name = name or unique_name(to_snake(type(self).__name__))
        self._trainable = trainable
        self.dtype = dtypes.as_dtype(dtype or "float32").name
        self.built = False
        self._own_weights: list[Variable] = []
        self._weight_names: dict[int, str] = {}  # id -> the name a checkpoint tracks it by
        self._sublayers: list[Layer] = []
        self._losses: list[Any] = []
        self._strategy = distribute_lib.get_strategy() if distribute_lib.has_strategy() else None
        if input_dim is not None and input_shape is None:
            input_shape = (input_dim,)
        if batch_input_shape is not None:
            self._batch_input_shape: tuple | None = tuple(batch_input_shape)
        elif input_shape is not None:
            shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
            self._batch_input_shape = (None, *shape)
        else:
            self._batch_input_shape = None

    # -- tracking --------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Layer) and name != "_parent" and "_sublayers" in self.__dict__:
            if value not in self._sublayers:
                self._sublayers.append(value)
        elif isinstance(value, (list, tuple)) and "_sublayers" in self.__dict__:
            for item in value:
                if isinstance(item, Layer) and item not in self._sublayers:
                    self._sublayers.append(item)
        object.__setattr__(self, name, value)

    def _flatten_layers(self) -> list[Layer]:
        out: list[Layer] = []
        for layer in self._sublayers:
            out.append(layer)
            out.extend(layer._flatten_layers())
        return out

    @property
    def trainable(self) -> bool:
        """Whether ``trainable_weights`` includes this layer's weights."""
        return self._trainable

    @trainable.setter
    def trainable(self, value: bool) -> None:
        self._trainable = bool(value)
        for layer in self._sublayers:
            layer.trainable = value

    @property
    def weights(self) -> list[Variable]:
        """All weights: this layer's, then its sublayers', in creation order (shards listed)."""
        seen: set[int] = set()
        out = []
        for v in [
            *_expand(self._own_weights),
            *(w for layer in self._sublayers for w in layer.weights),
        ]:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        return out

    @property
    def variables(self) -> list[Variable]:
        """Same as :attr:`weights`."""
        return self.weights

    @property
    def trainable_weights(self) -> list[Variable]:
        """The weights a tape should differentiate."""
        if not self._trainable:
            return []
        own = [v for v in _expand(self._own_weights) if v.trainable]
        for layer in self._sublayers:
            own.extend(layer.trainable_weights)
        return own

    @property
    def trainable_variables(self) -> list[Variable]:
        """Same as :attr:`trainable_weights`."""
        return self.trainable_weights

    @property
    def non_trainable_weights(self) -> list[Variable]:
        """The weights that are not trained."""
        trainable = {id(v) for v in self.trainable_weights}
        return [v for v in self.weights if id(v) not in trainable]

    @property
    def non_trainable_variables(self) -> list[Variable]:
        """Same as :attr:`non_trainable_weights`."""
        return self.non_trainable_weights

    @property
    def losses(self) -> list[Any]:
        """Regularization losses of this layer and its sublayers, for the current weights."""
        out = [fn() for fn in self._losses]
        for layer in self._sublayers:
            out.extend(layer.losses)
        return out

    def add_loss(self, loss: Any) -> None:
        """Adds a loss term (a callable is re-evaluated at each access)."""
        self._losses.append(loss if callable(loss) else (lambda: loss))

    # -- weights ---------------------------------------------------------------------
    def add_weight(
        self,
        name: str | None = None,
        shape: Any = None,
        dtype: Any = None,
        initializer: Any = None,
        regularizer: Any = None,
        trainable: bool = True,
        constraint: Any = None,
        **kwargs: Any,
    ) -> Variable:
        """Creates a weight in the layer's strategy scope and tracks it.

        Raises:
            InvalidArgumentError: a shape with negative or unknown dimensions.
        """
        shape = tuple(int(d) if d is not None else -1 for d in (shape or ()))
        if any(d < 0 for d in shape):
            raise errors.InvalidArgumentError(
                f"{self.name}: weight {name!r} needs a fully known shape >= 0, got {list(shape)}"
            )
        dt = dtypes.as_dtype(dtype or self.dtype)
        init = initializers.get(
            initializer
            if initializer is not None
            else ("zeros" if not dt.is_floating else "glorot_uniform")
        )
        vname = f"{self.name}/{name or 'weight'}"
        # how replicas' writes combine (BatchNormalization's moving statistics average)
        sync = {k: kwargs[k] for k in ("synchronization", "aggregation") if k in kwargs}

        def make() -> Variable:
            return Variable(
                lambda: init(shape, dt),
                trainable=trainable,
                name=vname,
                dtype=dt,
                constraint=constraint,
                **sync,
            )

        if self._strategy is not None and not distribute_lib.has_strategy():
            with self._strategy.scope():
                v = make()
        else:
            v = make()
        if not self._track_weight(name or "weight", v):
            return v
        if regularizer is not None:
            from psflow.keras import regularizers

            reg = regularizers.get(regularizer)
            self._losses.append(lambda: reg(v))
        return v

    def _track_weight(self, name: str, value: Any) -> bool:
        """Lists a new weight under ``name`` (its checkpoint name); False if listed already.

        A checkpoint restored before the weight existed gives it its value
        here, before any other thread can read it (deferred restoration).
        """
        # Built lazily inside MirroredStrategy.run, every replica thread creates the weight
        # (one merge_call hands all of them the same variable): track it once, or each
        # replica would see the others' appends at its own time and list it twice.
        with _track_lock:
            if any(w is value for w in self._own_weights):
                return False
            self._own_weights.append(value)
            self._weight_names[id(value)] = name
            deferred.child_created(self, name, value)
        return True

    checkpoint_grows = True

    def _tracked_layers(self) -> list[Layer]:
        """Layers a checkpoint names ``layer-<i>`` (a model's; none for a layer)."""
        return []

    def checkpoint_children(self) -> dict[str, Any]:
        """The named edges a checkpoint follows out of this layer, in a stable order."""
        from psflow.train.object_graph import trackable_attr

        out: dict[str, Any] = {}
        with_weights = 0
        for i, layer in enumerate(self._tracked_layers()):  # TensorFlow's order and paths
            if layer.weights:
                out[f"layer_with_weights-{with_weights}"] = layer
                with_weights += 1
            out[f"layer-{i}"] = layer
        for name, weight in self._named_weights():
            out.setdefault(name, weight)
        for name, value in vars(self).items():
            if not name.startswith("_") and trackable_attr(value):
                out.setdefault(name, value)
        return out

    def _named_weights(self) -> list[tuple[str, Any]]:
        """``(name, weight)`` for this layer's own weights, by the names they were made with."""
        out = []
        for w in self._own_weights:
            name = self._weight_names.get(id(w))
            if name is None:  # appended by hand: its variable name, less the layer's
                name = w.name.split(":")[0].removeprefix(f"{self.name}/")
            out.append((name, w))
        return out

    def get_weights(self) -> list[np.ndarray]:
        """The weights' values as NumPy arrays."""
        return [v.numpy() for v in self.weights]

    def set_weights(self, weights: list[Any]) -> None:
        """Assigns values to the weights, in :attr:`weights` order.

        Raises:
            InvalidArgumentError: the count or a shape differs, naming the weight.
        """
        current = self.weights
        if len(weights) != len(current):
            raise errors.InvalidArgumentError(
                f"{self.name}: set_weights got {len(weights)} arrays for {len(current)} weights"
            )
        for v, w in zip(current, weights):
            arr = np.asarray(w)
            if tuple(arr.shape) != tuple(v.shape):
                raise errors.InvalidArgumentError(
                    f"{self.name}: weight {v.name} has shape {list(v.shape)}, got {list(arr.shape)}"
                )
        for v, w in zip(current, weights):
            v.assign(np.asarray(w, dtype=v.dtype.np))

    def count_params(self) -> int:
        """Number of scalars in the weights."""
        return int(sum(int(np.prod(v.shape)) for v in self.weights))

    # -- building and calling ----------------------------------------------------------
    def build(self, input_shape: Any) -> None:
        """Creates the weights for inputs of ``input_shape`` (batch dimension first)."""
        self.built = True

    def call(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The layer's computation."""
        return inputs

    def compute_output_shape(self, input_shape: Any) -> Any:
        """The output shape for an input shape (by a trial call when not overridden)."""
        shape = tuple(input_shape)
        dummy = Tensor._wrap(
            backend.xp_for(backend.current_device()).zeros(
                tuple(1 if d is None else d for d in shape), dtype=self.dtype
            )
        )
        out = self(dummy)
        return TensorShape((shape[0], *tuple(out.shape)[1:]))

    def _maybe_build(self, input_shape: Any) -> None:
        if self.built:
            return
        flat = isinstance(input_shape, (tuple, list)) and all(
            d is None or isinstance(d, (int, np.integer)) for d in input_shape
        )
        shape = (
            TensorShape(input_shape) if flat else input_shape
        )  # nested inputs keep nested shapes
        if self._strategy is not None and not distribute_lib.has_strategy():
            with self._strategy.scope():
                self.build(shape)
        else:
            self.build(shape)
        self.built = True

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if keras_tensor.is_symbolic(inputs):  # building a functional graph, not computing
            return keras_tensor.symbolic_call(self, (inputs, *args), kwargs)
        if not self.built:
            self._maybe_build(_shape_of(inputs))
        if "training" in kwargs and not _takes_training(type(self)):
            kwargs.pop("training")
        return self.call(inputs, *args, **kwargs)

    # -- config ----------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Constructor arguments."""
        config: dict[str, Any] = {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": self.dtype,
        }
        if self._batch_input_shape is not None:
            config["batch_input_shape"] = self._batch_input_shape
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Layer:
        """Rebuilds from :meth:`get_config`."""
        return cls(**config)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name}, built={self.built}>"


def _expand(weights: list[Any]) -> list[Any]:
    """Weights with every sharded variable replaced by its shards (TensorFlow lists shards too)."""
    out = []
    for w in weights:
        if type(w) is Variable:  # a plain variable has no shards (every step asks)
            out.append(w)
            continue
        shards = getattr(w, "_shard_variables", None)
        out.extend(shards if shards is not None else [w])
    return out


def _shape_of(inputs: Any) -> tuple:
    if isinstance(inputs, (list, tuple)) and inputs and not isinstance(inputs[0], (int, float)):
        return tuple(_shape_of(i) for i in inputs)
    if isinstance(inputs, dict):
        return {k: _shape_of(v) for k, v in inputs.items()}  # type: ignore[return-value]
    return tuple(to_array(inputs).shape)
