"""psflow: parameter-server and mirrored data-parallel training, TensorFlow's way.

``import psflow as tf`` gives the names a ``tf.distribute`` training script
uses: tensors and variables, math ops, ``GradientTape``, ``data``, ``keras``
and ``distribute``, on NumPy (CPU) or CuPy (GPU).

Example:
    >>> import psflow as tf
    >>> print(tf.constant([1, 2, 3, 4, 5]) + 1)
    psflow.Tensor([2 3 4 5 6], shape=(5,), dtype=int32)
"""

import importlib as _importlib

from psflow import errors, random
from psflow.backend import device
from psflow.dtypes import (
    DType,
    as_dtype,
    bool,
    double,
    float16,
    float32,
    float64,
    half,
    int8,
    int16,
    int32,
    int64,
    string,
    uint8,
    uint16,
    uint32,
    uint64,
)
from psflow.framework.indexed_slices import IndexedSlices
from psflow.framework.tape import GradientTape, UnconnectedGradients
from psflow.framework.tensor import Tensor, TensorShape, constant, convert_to_tensor, is_tensor
from psflow.framework.variable import (
    Variable,
    VariableAggregation,
    VariableSynchronization,
    variable_creator_scope,
)
from psflow.function import function
from psflow.ops import operators as _operators
from psflow.ops.array_ops import (
    argmax,
    argmin,
    boolean_mask,
    broadcast_to,
    concat,
    expand_dims,
    eye,
    fill,
    gather,
    gather_nd,
    identity,
    linspace,
    one_hot,
    ones,
    ones_like,
    pad,
    range,
    rank,
    reshape,
    reverse,
    shape,
    size,
    slice,
    split,
    squeeze,
    stack,
    stop_gradient,
    tile,
    transpose,
    unstack,
    where,
    zeros,
    zeros_like,
)
from psflow.ops.clip_ops import clip_by_global_norm, clip_by_norm, clip_by_value
from psflow.ops.math_ops import (
    abs,
    add,
    add_n,
    cast,
    cos,
    cumsum,
    divide,
    equal,
    exp,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    logical_and,
    logical_not,
    logical_or,
    matmul,
    maximum,
    minimum,
    multiply,
    negative,
    not_equal,
    pow,
    reduce_all,
    reduce_any,
    reduce_logsumexp,
    reduce_max,
    reduce_mean,
    reduce_min,
    reduce_prod,
    reduce_std,
    reduce_sum,
    reduce_variance,
    round,
    rsqrt,
    sigmoid,
    sign,
    sin,
    sqrt,
    square,
    squared_difference,
    subtract,
    tanh,
    tensordot,
    truediv,
)
from psflow.util import nest


def __getattr_tensorspec():  # TensorSpec lives with the data package; loaded on first use
    from psflow.data.structure import TensorSpec

    return TensorSpec


__version__ = "0.1.0"

_operators.install(Tensor)
_operators.install(Variable)

newaxis = None

# Subpackages that pull in more (gRPC, the Keras layers) load on first use.
_LAZY = {
    "data": "psflow.data",
    "keras": "psflow.keras",
    "distribute": "psflow.distribute",
    "config": "psflow.config",
    "train": "psflow.train",
    "math": "psflow.math",
    "nn": "psflow.nn",
    "collective": "psflow.collective",
    "summary": "psflow.summary",
}


def __getattr__(name: str):
    if name == "TensorSpec":
        value = __getattr_tensorspec()
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psflow' has no attribute {name!r}")
    value = _importlib.import_module(module)
    globals()[name] = value
    return value


def print(*inputs, **kwargs) -> None:
    """Prints tensors by value (TensorFlow's ``tf.print``) to stdout."""
    import builtins

    builtins.print(*(x.numpy() if is_tensor(x) else x for x in inputs), **kwargs)
