"""``keras.Model``: ``compile``, ``fit``, ``evaluate``, ``predict`` and weight files."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from psflow import errors
from psflow.distribute import distribute_lib
from psflow.framework.tape import GradientTape
from psflow.framework.tensor import Tensor
from psflow.keras import callbacks as callbacks_lib
from psflow.keras import losses as losses_lib
from psflow.keras import metrics as metrics_lib
from psflow.keras import optimizers as optimizers_lib
from psflow.keras.engine import data_adapter
from psflow.keras.engine.runner import runner_for
from psflow.keras.layers.base import Layer
from psflow.observability import events, progress
from psflow.ops import math_ops
from psflow.train import deferred
from psflow.util import nest


class _NotCompiledError(errors.FailedPreconditionError, ValueError):
    """Training or evaluating before ``compile``: TF's precondition error, and a
    ``ValueError`` as Keras 3 raises."""


class Model(Layer):
    """A layer with training methods (Keras's ``keras.Model``).

    Three ways to make one: ``Model(inputs, outputs)`` over ``keras.Input``s
    (the functional API, see :class:`~psflow.keras.engine.functional.Functional`),
    :class:`Sequential`, or a subclass that defines ``call``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Keras's rule: Model(inputs, outputs) is a functional model.
        if cls is Model and (args or "inputs" in kwargs or "outputs" in kwargs):
            from psflow.keras.engine.functional import Functional

            return super().__new__(Functional)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or "inputs" in kwargs or "outputs" in kwargs:
            raise errors.UnimplementedError(
                f"{type(self).__name__}: a subclassed Model cannot take inputs/outputs; build a "
                "functional model with keras.Model(inputs, outputs) or define call()"
            )
        super().__init__(**kwargs)
        self.optimizer: Any = None
        self.loss: Any = None
        self.compiled = False
        self.stop_training = False
        with metrics_lib.local_metrics():  # fit aggregates these itself, on the chief
            self._loss_tracker = metrics_lib.Mean(name="loss")
        self._compiled_metrics: list[metrics_lib.Metric] = []
        self._metric_outputs: list[int | None] = []  # which output each metric reads (None: all)
        self._output_losses: Any = None  # compile_utils.OutputLosses for several outputs
        self._compile_config: dict[str, Any] | None = None
        self._build_input_shape: Any = None  # what the model was built for: saved with it
        self._unwrap_single = False  # one output in a list/dict: losses see the bare tensors
        self._global_batch_size: int | None = None
        self._steps_per_execution = 1  # batches per call into the step function (compile)

    # -- compile ---------------------------------------------------------------------
    def compile(
        self,
        optimizer: Any = "rmsprop",
        loss: Any = None,
        metrics: Any = None,
        loss_weights: Any = None,
        weighted_metrics: Any = None,
        run_eagerly: Any = None,
        steps_per_execution: Any = None,
        jit_compile: Any = None,
        **kwargs: Any,
    ) -> None:
        """Sets the optimizer, the loss and the metrics used by ``fit`` and ``evaluate``.

        ``steps_per_execution`` (an int >= 1, None for 1): the batches each call into
        the step function runs, under the default strategy and MirroredStrategy;
        under ParameterServerStrategy in async mode, the batches of one step
        closure (a worker runs them one after another; sync and bounded
        closures, and MultiWorkerMirroredStrategy, run one). Batch
        callbacks then run once per execution, as Keras calls them:
        ``on_train_batch_begin`` with the index of its first batch,
        ``on_train_batch_end`` with its last; the last execution of an epoch may be
        shorter. The weights are those of one step per execution.

        Raises:
            ValueError: an unknown optimizer, loss or metric name (quoted).
            InvalidArgumentError: ``steps_per_execution`` not an int >= 1 (quoted).
        """
        self._steps_per_execution = _steps_per_execution(steps_per_execution)
        names = self.output_names or []
        with self._strategy_scope():
            self.optimizer = optimizers_lib.get(optimizer)
        deferred.child_created(self, "optimizer", self.optimizer)  # a restore waiting for it
        routes: list[int | None]
        if len(names) > 1:  # several outputs: Keras's per-output losses and metrics
            from psflow.keras.engine import compile_utils

            self._output_losses = (
                None if loss is None else compile_utils.OutputLosses(loss, loss_weights, names)
            )
            self.loss = None if loss is None else self._output_losses
            pairs = compile_utils.output_metrics(metrics, names) + compile_utils.output_metrics(
                weighted_metrics, names
            )
            compiled = [m for m, _ in pairs]
            routes = [i for _, i in pairs]
        else:
            if len(names) == 1:  # one output, maybe in a list or dict: Keras's plain names
                metrics = _single_output_entries(metrics)
                weighted_metrics = _single_output_entries(weighted_metrics)
                if isinstance(loss, (dict, list, tuple)) and len(loss) == 1:
                    loss = next(iter(loss.values())) if isinstance(loss, dict) else loss[0]
            self._output_losses = None
            self.loss = None if loss is None else losses_lib.get(loss)
            with metrics_lib.local_metrics():
                compiled = [
                    metrics_lib.get(m) for m in [*(metrics or []), *(weighted_metrics or [])]
                ]
            routes = [None] * len(compiled)
        # a metric the user built in a parameter-server scope: fit keeps a local twin of it
        self._compiled_metrics = [m if m.ps_backing is None else _local_twin(m) for m in compiled]
        self._metric_outputs = routes
        self._unwrap_single = len(names) == 1
        self._compile_config = {
            "optimizer": optimizer,
            "loss": loss,
            "metrics": metrics,
            "loss_weights": loss_weights,
            "weighted_metrics": weighted_metrics,
            # saved with the model, as Keras does: load_model compiles with it again
            "steps_per_execution": self._steps_per_execution,
        }
        self.compiled = True

    def _maybe_build(self, input_shape: Any) -> None:
        if not self.built and self._build_input_shape is None:
            self._build_input_shape = _unbatched(input_shape)
        super()._maybe_build(input_shape)

    def _strategy_scope(self) -> Any:
        import contextlib

        if self._strategy is not None and not distribute_lib.has_strategy():
            return self._strategy.scope()
        return contextlib.nullcontext()

    @property
    def distribute_strategy(self) -> Any:
        """The strategy the model was created under (the default strategy otherwise)."""
        return self._strategy or distribute_lib.get_strategy()

    @property
    def output_names(self) -> list[str] | None:
        """Names of the outputs; None where the model does not declare them (subclassed)."""
        return None

    @property
    def metrics(self) -> list[metrics_lib.Metric]:
        """The loss tracker, the per-output loss trackers and the compiled metrics."""
        if not self.compiled:
            return []
        per_output = self._output_losses.metrics if self._output_losses is not None else []
        return [self._loss_tracker, *per_output, *self._compiled_metrics]

    @property
    def metrics_names(self) -> list[str]:
        """Names of :attr:`metrics`."""
        return [m.name for m in self.metrics]

    def reset_metrics(self) -> None:
        """Clears every metric's state."""
        for m in self.metrics:
            m.reset_state()

    def _current_logs(self) -> dict[str, float]:
        # a multi-worker strategy combines every worker's metric state here
        return self.distribute_strategy.extended.metric_results(self.metrics)

    def _assert_compiled(self, what: str) -> None:
        if not self.compiled:
            raise _NotCompiledError(f"You must call compile() before {what}()")

    # -- steps -----------------------------------------------------------------------
    def compute_loss(
        self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None
    ) -> Tensor:
        """The compiled loss of a batch plus the model's regularization losses."""
        if self.loss is None:
            raise errors.FailedPreconditionError(
                "compile() was called without a loss; train_step needs one"
            )
        if y is None:
            raise errors.InvalidArgumentError(
                "Training needs targets: give y (or a dataset of (x, y))"
            )
        if self._unwrap_single:
            y, y_pred, sample_weight = (_unwrap(v) for v in (y, y_pred, sample_weight))
        loss = self.loss(_match_rank(y, y_pred, self.loss), y_pred, sample_weight)
        extra = self.losses
        if extra:
            loss = math_ops.add(loss, math_ops.add_n([math_ops.cast(e, loss.dtype) for e in extra]))
        return loss

    def _loss_scale(self, batch_size: int) -> float:
        ctx = distribute_lib.get_replica_context()
        if ctx is None or not distribute_lib.has_strategy():
            return 1.0
        n = ctx.num_replicas_in_sync
        if n <= 1:
            return 1.0
        global_batch = self._global_batch_size or batch_size * n
        return batch_size / global_batch

    def train_step(self, data: Any) -> dict[str, Any]:
        """One step: forward, loss, gradients, optimizer update, metrics. Override to customize."""
        # host batches go to this replica's device here, where every runner's step runs
        data = data_adapter.on_device(data)
        x, y, sample_weight = data_adapter.unpack_x_y_sample_weight(data)
        batch_size = data_adapter.batch_size_of(x)
        with GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred, sample_weight)
            scale = self._loss_scale(batch_size)
            scaled = math_ops.multiply(loss, scale) if scale != 1.0 else loss
        variables = self.trainable_variables
        if self.optimizer._takes_product_gradients(variables):
            # a dense weight's gradient as its two factors: the optimizer multiplies them out
            # block by block of the weight, updating each block while it is in cache
            grads = tape._gradient_for_update(scaled, variables)
        else:
            grads = tape.gradient(scaled, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        return self._update_metrics(loss, y, y_pred, sample_weight, batch_size)

    def test_step(self, data: Any) -> dict[str, Any]:
        """One evaluation step: forward, loss, metrics."""
        data = data_adapter.on_device(data)
        x, y, sample_weight = data_adapter.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        loss = self.compute_loss(x, y, y_pred, sample_weight)
        return self._update_metrics(loss, y, y_pred, sample_weight, data_adapter.batch_size_of(x))

    def predict_step(self, data: Any) -> Any:
        """One prediction step."""
        x, _, _ = data_adapter.unpack_x_y_sample_weight(data_adapter.on_device(data))
        return self(x, training=False)

    def _update_metrics(
        self, loss: Any, y: Any, y_pred: Any, sample_weight: Any, batch_size: int
    ) -> dict[str, Any]:
        # one host copy of the step's outputs serves every metric (else each copies its own)
        loss, y, y_pred, sample_weight = metrics_lib.on_host((loss, y, y_pred, sample_weight))
        self._loss_tracker.update_state(loss, sample_weight=np.float64(batch_size))
        for m, index in zip(self._compiled_metrics, self._metric_outputs):
            if index is None and self._unwrap_single:
                m.update_state(_unwrap(y), _unwrap(y_pred), _unwrap(sample_weight))
            elif index is None:
                m.update_state(y, y_pred, sample_weight)
            else:
                from psflow.keras.engine import compile_utils

                picked = compile_utils.select(self.output_names, index, y, y_pred, sample_weight)
                m.update_state(*picked)
        return {m.name: m.result() for m in self.metrics}

    def _runner(self) -> Any:
        return runner_for(self, self.distribute_strategy)

    def _ensure_built(self, source: Any) -> None:
        if self.built:
            return
        from psflow.distribute.values import select_replica

        first = select_replica(0, source.peek())  # a distributed element: replica 0's share
        x, _, _ = data_adapter.unpack_x_y_sample_weight(first)
        x = data_adapter.on_device(data_adapter.as_tensors(x))
        with self._strategy_scope():
            self(x, training=False)

    # -- fit / evaluate / predict ------------------------------------------------------
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: Any = "auto",
        callbacks: Any = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        class_weight: Any = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int = 1,
        **kwargs: Any,
    ) -> callbacks_lib.History:
        """Trains for ``epochs`` epochs; returns a :class:`History` of per-epoch logs.

        Raises:
            FailedPreconditionError: ``compile`` was not called (also a ValueError).
            InvalidArgumentError: mismatched x/y lengths, bad batch size, bad split.
            TypeError: data that is neither numbers nor text, naming the input.
        """
        self._assert_compiled("fit")
        if class_weight is not None:
            raise errors.UnimplementedError("class_weight is not supported; pass sample_weight")
        if int(epochs) < 0 or (steps_per_epoch is not None and int(steps_per_epoch) <= 0):
            raise errors.InvalidArgumentError(
                f"epochs must be >= 0 and steps_per_epoch > 0, got {epochs}, {steps_per_epoch}"
            )
        verbose = 1 if verbose == "auto" else int(verbose)
        train = data_adapter.make_batches(x, y, sample_weight, batch_size, shuffle, steps_per_epoch)
        val = None
        if validation_split:
            if not isinstance(train, data_adapter.ArrayBatches):
                raise errors.InvalidArgumentError(
                    "validation_split is only supported for array inputs"
                )
            train, val = train.split(validation_split)
        if validation_data is not None:
            vx, vy, vsw = (
                data_adapter.unpack_x_y_sample_weight(validation_data)
                if isinstance(validation_data, (tuple, list))
                else (validation_data, None, None)
            )
            val = data_adapter.make_batches(
                vx,
                vy,
                vsw,
                validation_batch_size or (batch_size if not data_adapter._is_dataset(vx) else None),
                False,
                validation_steps,
                "validation_data",
            )
        self._ensure_built(train)
        runner = self._runner()
        source = runner.prepare(train)
        steps = steps_per_epoch or runner.steps_estimate(source)
        history = callbacks_lib.History()
        cb_list = list(callbacks or [])
        if verbose:
            cb_list.append(callbacks_lib.ProgbarLogger())
        cb_list.append(history)
        if progress.installed() is not None:  # the chief's dashboard follows every fit
            cb_list.append(callbacks_lib.ProgressPublisher(progress.installed()))
        cbs = callbacks_lib.CallbackList(
            cb_list, self, {"verbose": verbose, "epochs": epochs, "steps": steps}
        )
        self.stop_training = False
        logs: dict[str, Any] = {}
        backups = [cb for cb in cb_list if isinstance(cb, callbacks_lib.BackupAndRestore)]
        cbs.on_train_begin()
        epoch = runner.first_epoch(initial_epoch)
        first_step = 0  # batches of the first epoch a backup holds done already
        for cb in backups:  # a restarted chief continues where the backup left off
            resumed = cb.restore()
            if resumed is not None and resumed >= epoch:
                epoch, first_step = resumed, cb.initial_step
            else:  # initial_epoch is past the backup: its epoch starts at batch 0
                cb.initial_step = 0
        while epoch < epochs:
            self.reset_metrics()
            cbs.on_epoch_begin(epoch)
            try:
                runner.train_epoch(source, steps_per_epoch, cbs, epoch=epoch, first_step=first_step)
            except (errors.UnavailableError, errors.NotFoundError) as e:
                # a PS task that died (unavailable) or came back empty (variables not found)
                epoch = self._recover_from_ps_loss(e, backups, runner)
                first_step = backups[0].initial_step
                continue
            first_step = 0
            logs = self._current_logs()
            if val is not None and (epoch + 1) % validation_freq == 0:
                val_logs = self._evaluate_source(
                    val, validation_steps, callbacks_lib.CallbackList([], self, {})
                )
                logs.update({f"val_{k}": v for k, v in val_logs.items()})
            cbs.on_epoch_end(epoch, logs)
            epoch += 1
            if self.stop_training:
                break
        cbs.on_train_end(logs)
        self.history = history
        return history

    def _recover_from_ps_loss(self, error: errors.OpError, backups: list[Any], runner: Any) -> int:
        """A parameter server was lost mid-epoch: roll every PS back to the last backup.

        Returns the epoch to continue from.

        Raises:
            PSUnavailableError: no BackupAndRestore callback (automatic recovery is
                off), or the PS did not come back in time; names the task.
        """
        task = error.task or ""
        if not task.startswith("ps") or not runner.recovers_from_ps_loss:
            raise error
        if not backups:
            raise errors.PSUnavailableError(
                f"Parameter server {task} was lost and automatic recovery is off (add a "
                f"keras.callbacks.BackupAndRestore to fit): {error.message}",
                task=task,
            ) from error
        import logging

        from psflow.distribute.ps.recovery import ENV_PS_TIMEOUT, RecoveryConfig

        config = RecoveryConfig.from_environ()
        logging.getLogger("psflow.keras").warning(
            "parameter server %s was lost (%s); waiting up to %.0fs (%s) for it to come back, "
            "then restoring the last backup",
            task,
            error.message,
            config.ps_timeout,
            ENV_PS_TIMEOUT,
        )
        runner.wait_for_parameter_servers(config)
        resumed = backups[0].restore()
        events.publish(events.EventKind.PS_RESTORED, task, f"{task} restored from the backup")
        return resumed if resumed is not None else 0

    def _evaluate_source(self, source: Any, steps: int | None, cbs: Any) -> dict[str, float]:
        self._ensure_built(source)
        runner = self._runner()
        source = runner.prepare(source)
        self.reset_metrics()
        cbs.on_test_begin()
        runner.test_epoch(source, steps, cbs)
        logs = self._current_logs()
        cbs.on_test_end(logs)
        return logs

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: Any = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Any = None,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """The loss and metrics over the data: a scalar, a list, or a dict with ``return_dict``."""
        self._assert_compiled("evaluate")
        verbose = 1 if verbose == "auto" else int(verbose)
        source = data_adapter.make_batches(
            x, y, sample_weight, batch_size, False, steps, "evaluate"
        )
        cb_list = list(callbacks or [])
        if verbose:
            cb_list.append(callbacks_lib.ProgbarLogger())
        cbs = callbacks_lib.CallbackList(
            cb_list,
            self,
            {
                "verbose": verbose,
                "steps": steps or getattr(source, "steps", None),
                "_evaluate_alone": True,
            },
        )
        logs = self._evaluate_source(source, steps, cbs)
        if return_dict:
            return logs
        values = [logs[name] for name in self.metrics_names]
        return values[0] if len(values) == 1 else values

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: Any = "auto",
        steps: int | None = None,
        callbacks: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Predictions for every example, concatenated into NumPy arrays.

        ``verbose`` as in Keras: ``"auto"`` or 1 a progress bar, 2 one line at the
        end, 0 silent.
        """
        verbose = 1 if verbose == "auto" else int(verbose)
        source = data_adapter.make_batches(x, None, None, batch_size, False, steps, "predict")
        self._ensure_built(source)
        runner = self._runner()
        source = runner.prepare(source)
        cb_list = list(callbacks or [])
        if verbose:
            cb_list.append(callbacks_lib.ProgbarLogger())
        cbs = callbacks_lib.CallbackList(
            cb_list,
            self,
            {"verbose": verbose, "steps": steps or getattr(source, "steps", None), "epochs": 1},
        )
        cbs.on_predict_begin()
        outputs = runner.predict(source, steps, cbs)
        cbs.on_predict_end()
        if not outputs:
            raise errors.InvalidArgumentError("predict: the input produced no batches")
        return nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)

    def train_on_batch(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """One training step on one batch; returns the batch's loss (and metrics)."""
        self._assert_compiled("train_on_batch")
        batch = data_adapter.as_tensors((x, y) if sample_weight is None else (x, y, sample_weight))
        self.reset_metrics()
        self.distribute_strategy.run(self.train_step, args=(batch,))
        logs = self._current_logs()
        return (
            logs
            if return_dict
            else ([logs[n] for n in self.metrics_names] if len(logs) > 1 else logs["loss"])
        )

    def test_on_batch(
        self, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False
    ) -> Any:
        """The loss (and metrics) of one batch."""
        self._assert_compiled("test_on_batch")
        batch = data_adapter.as_tensors((x, y) if sample_weight is None else (x, y, sample_weight))
        self.reset_metrics()
        self.distribute_strategy.run(self.test_step, args=(batch,))
        logs = self._current_logs()
        return (
            logs
            if return_dict
            else ([logs[n] for n in self.metrics_names] if len(logs) > 1 else logs["loss"])
        )

    def predict_on_batch(self, x: Any) -> Any:
        """Predictions for one batch, as NumPy arrays."""
        y = self.predict_step(data_adapter.as_tensors(x))
        return nest.map_structure(lambda t: t.numpy(), y)

    # -- weights files -----------------------------------------------------------------
    def save_weights(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """Writes every weight to ``filepath`` (safetensors format; written atomically)."""
        from psflow.io import safetensors

        filepath = os.fspath(filepath)
        if not overwrite and os.path.exists(filepath):
            raise errors.AlreadyExistsError(f"{filepath} exists and overwrite=False")
        tensors = {f"{i:04d}:{v.name}": v.numpy() for i, v in enumerate(self.weights)}
        safetensors.save_file(filepath, tensors, metadata={"format": "psflow-keras-weights"})

    def load_weights(self, filepath: str, skip_mismatch: bool = False, **kwargs: Any) -> None:
        """Loads weights written by :meth:`save_weights`, in order.

        Raises:
            NotFoundError: no such file.
            InvalidArgumentError: the file holds a different number or shape of weights.
        """
        from psflow.io import safetensors

        filepath = os.fspath(filepath)
        if not os.path.exists(filepath):
            raise errors.NotFoundError(f"No weights file at {filepath!r}")
        loaded = safetensors.load_file(filepath)
        arrays = [loaded[k] for k in sorted(loaded)]
        if not self.built:
            raise errors.FailedPreconditionError(
                "Build the model (call it or fit it) before load_weights"
            )
        self.set_weights(arrays)

    def summary(self, line_length: int | None = None, print_fn: Any = None, **kwargs: Any) -> None:
        """Prints a table of layers, output shapes and parameter counts (Keras's format).

        Functional models get a fourth column, the layers each one is connected to.
        """
        from psflow.keras.engine import summary as summary_lib

        summary_lib.print_summary(self, self._summary_rows(), line_length, print_fn)

    def _summary_rows(self) -> list[tuple[Any, str, str | None]]:
        """(layer, output shape, connected-to or None) per layer; layers chained in order."""
        from psflow.keras.engine import summary as summary_lib

        return summary_lib.chained_rows(self)

    # -- whole-model files ------------------------------------------------------------
    def save(self, filepath: str, overwrite: bool = True, include_optimizer: bool = True) -> None:
        """Saves architecture, weights and compile settings to a ``.keras`` file or a directory.

        See :func:`psflow.keras.saving.save_model`.
        """
        from psflow.keras.saving import saving_lib

        saving_lib.save_model(
            self, filepath, overwrite=overwrite, include_optimizer=include_optimizer
        )


def _steps_per_execution(value: Any) -> int:
    """``compile``'s ``steps_per_execution`` as an int >= 1 (None: 1).

    Raises:
        InvalidArgumentError: a bool, a non-integer or a value below 1, quoted.
    """
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise errors.InvalidArgumentError(
            f"compile: steps_per_execution must be an int >= 1, got {value!r}"
        )
    return int(value)


def _single_output_entries(metrics: Any) -> Any:
    """Metrics for a model's only output, given as a dict or a list with one entry per output."""
    if isinstance(metrics, dict):
        metrics = list(metrics.values())
    if isinstance(metrics, (list, tuple)) and len(metrics) == 1:
        only = metrics[0]
        return list(only) if isinstance(only, (list, tuple)) else [only]
    return metrics


def _match_rank(y: Any, y_pred: Any, loss: Any = None) -> Any:
    """Labels ``(n,)`` against predictions ``(n, k)`` become ``(n, 1)``, as Keras's compiled
    loss makes them (so ``mse`` broadcasts a label over ``k`` outputs as in TensorFlow).

    Not for a sparse categorical cross-entropy ``loss``: it takes ``(n,)`` class ids as
    they are (and would squeeze ``(n, 1)`` back), so two ops per step are saved.
    """
    if not (isinstance(y, Tensor) and isinstance(y_pred, Tensor)):
        return y
    if getattr(loss, "fn", None) is losses_lib.sparse_categorical_crossentropy:
        return y
    if y.shape.rank == 1 and y_pred.shape.rank == 2:
        from psflow.ops import array_ops

        return array_ops.expand_dims(y, -1)
    return y


def _unwrap(value: Any) -> Any:
    """The one entry of a one-element list or dict (a single output's structure)."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return value[0]
    if isinstance(value, dict) and len(value) == 1:
        return next(iter(value.values()))
    return value


def _unbatched(shape: Any) -> Any:
    """A build shape with the batch dimension unknown (it is not part of the model)."""
    from psflow.keras.engine.keras_tensor import is_shape

    if isinstance(shape, dict):
        return {k: _unbatched(v) for k, v in shape.items()}
    if is_shape(shape):
        return (None, *tuple(shape)[1:]) if len(shape) else ()
    if isinstance(shape, (list, tuple)):
        return [_unbatched(s) for s in shape]
    return None


def _local_twin(metric: metrics_lib.Metric) -> metrics_lib.Metric:
    import copy

    twin = copy.copy(metric)
    twin._ps = None
    twin._lock = type(metric._lock)()
    twin._clear_local()
    return twin
