"""``keras.utils.experimental.DatasetCreator``: ``fit`` input as a per-pipeline dataset function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from psflow.distribute import input_lib


class DatasetCreator(input_lib.DatasetFunction):
    """Wraps ``dataset_fn(input_context) -> dataset`` for ``Model.fit`` (Keras's ``DatasetCreator``).

    Under ParameterServerStrategy every worker calls ``dataset_fn`` with an
    ``InputContext`` naming its pipeline (``input_pipeline_id`` = worker index,
    ``num_input_pipelines`` = workers), so it can shard and batch its own data;
    under other strategies it is called once, for the single pipeline.
    ``fit`` then needs ``steps_per_epoch`` (and ``validation_steps``,
    ``evaluate``'s ``steps``), as in TensorFlow: the dataset may be infinite.

    Each step trains one element of one pipeline, once, even when its worker
    dies and another worker re-runs it (it rebuilds that pipeline and reads the
    same position), provided ``dataset_fn`` builds the same dataset every time
    for the same context (seed its shuffles). A finite dataset is then read
    exactly once over the epochs; a ``repeat()`` dataset has no epoch, and
    training runs on from where the previous epoch stopped.

    Example:
        >>> import psflow as tf
        >>> def dataset_fn(ctx):
        ...     return tf.data.Dataset.range(8).shard(
        ...         ctx.num_input_pipelines, ctx.input_pipeline_id).batch(2)
        >>> creator = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
        >>> ctx = tf.distribute.InputContext(2, 1, 1)
        >>> [b.numpy().tolist() for b in creator(ctx)]
        [[1, 3], [5, 7]]

    Args:
        dataset_fn: a callable taking an ``InputContext``, returning a dataset.
        input_options: accepted for TensorFlow compatibility (placement is psflow's).

    Raises:
        TypeError: ``dataset_fn`` is not callable.
    """

    def __init__(self, dataset_fn: Callable[[Any], Any], input_options: Any = None) -> None:
        super().__init__(dataset_fn)
        self.input_options = input_options
