"""``model.save`` / ``keras.models.load_model``: architecture as JSON, weights as safetensors.

A saved model is three entries: ``config.json`` (the model's class and
config, its build input shape and, optionally, its compile settings),
``metadata.json`` (format and version) and ``model.weights.safetensors``
(every weight, in ``model.weights`` order). A path ending in ``.keras`` holds
them in one zip file; any other path is a directory holding them. Both are
written to a temporary name first and renamed, so a crash never leaves a
half-written model behind.

Loading inside a strategy's ``scope()`` creates the variables there
(mirrored, or on the parameter servers), then assigns the saved values.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from typing import Any

import numpy as np

from psflow import errors
from psflow.keras.saving import serialization

FORMAT = "psflow-keras-model"
VERSION = 1
CONFIG = "config.json"
METADATA = "metadata.json"
WEIGHTS = "model.weights.safetensors"


def _is_zip_path(path: str) -> bool:
    return path.endswith(".keras")


def _compile_config(model: Any) -> dict[str, Any] | None:
    from psflow.keras import losses as losses_lib
    from psflow.keras import optimizers as optimizers_lib

    config = model._compile_config
    if not model.compiled or config is None:
        return None
    out = dict(config)
    out["optimizer"] = optimizers_lib.serialize(model.optimizer)

    def plain(value: Any) -> Any:
        # a built-in loss class, by name and config, when that config rebuilds it (a
        # wrapped user function does not: the model then loads uncompiled)
        cls = type(value)
        if isinstance(value, losses_lib.Loss) and getattr(losses_lib, cls.__name__, None) is cls:
            try:
                cls.from_config(value.get_config())
            except TypeError:
                return value
            return {"class_name": cls.__name__, "config": value.get_config()}
        return value

    out["loss"] = (
        {k: plain(v) for k, v in out["loss"].items()}
        if isinstance(out["loss"], dict)
        else [plain(v) for v in out["loss"]]
        if isinstance(out["loss"], (list, tuple))
        else plain(out["loss"])
    )
    try:
        json.dumps(out)
    except (TypeError, ValueError):
        return None  # objects without a config (custom metrics...): the model loads uncompiled
    return out


def save_model(
    model: Any, filepath: Any, overwrite: bool = True, include_optimizer: bool = True
) -> None:
    """Writes ``model`` (architecture, weights, compile settings) to ``filepath``.

    Args:
        filepath: ``*.keras`` for one zip file, anything else for a directory.
        include_optimizer: also record the optimizer and the compile arguments,
            so that ``load_model`` returns a compiled model (optimizer slots are
            not saved: training resumes with fresh slots).

    Raises:
        AlreadyExistsError: ``filepath`` exists and ``overwrite`` is False.
        UnimplementedError: an ``.h5``/``.hdf5`` path (Keras's legacy format).
        FailedPreconditionError: the model is not built yet.
        InvalidArgumentError: a layer whose config cannot be written as JSON.
    """
    from psflow.io import safetensors

    path = os.fspath(filepath)
    if path.endswith((".h5", ".hdf5")):
        raise errors.UnimplementedError(
            f"{path!r}: HDF5 model files are not supported; save to a '.keras' file or a directory"
        )
    if not overwrite and os.path.exists(path):
        raise errors.AlreadyExistsError(f"{path} exists and overwrite=False")
    if not model.built:
        raise errors.FailedPreconditionError(
            f"{model.name}: build the model (call it or fit it) before saving it"
        )
    config = {
        "model": serialization.serialize_keras_object(model),
        "build_config": {
            "input_shape": _jsonable_shape(
                model._build_input_shape
                if model._build_input_shape is not None
                else model._batch_input_shape
            )
        },
        "compile_config": _compile_config(model) if include_optimizer else None,
    }
    try:
        config_text = json.dumps(config, indent=1)
    except (TypeError, ValueError) as e:
        raise errors.InvalidArgumentError(
            f"{model.name}: the model's config cannot be written as JSON ({e}); every layer's "
            "get_config() must return JSON-able values"
        ) from e
    metadata = json.dumps({"format": FORMAT, "version": VERSION})
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".psflow-save-", dir=parent)
    try:
        tensors = {f"{i:05d}:{v.name}": np.asarray(v.numpy()) for i, v in enumerate(model.weights)}
        staged = os.path.join(work, "staged")
        os.makedirs(staged)
        safetensors.save_file(os.path.join(staged, WEIGHTS), tensors, metadata={"format": FORMAT})
        with open(os.path.join(staged, CONFIG), "w") as f:
            f.write(config_text)
        with open(os.path.join(staged, METADATA), "w") as f:
            f.write(metadata)
        if _is_zip_path(path):
            archive = os.path.join(work, "model.keras")
            with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
                for name in (METADATA, CONFIG, WEIGHTS):
                    z.write(os.path.join(staged, name), name)
            os.replace(archive, path)
        else:
            if os.path.isdir(path):
                old = os.path.join(work, "old")
                os.replace(path, old)  # swapped out, removed with the work directory
            elif os.path.exists(path):
                os.remove(path)
            os.replace(staged, path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _jsonable_shape(shape: Any) -> Any:
    if shape is None:
        return None
    if isinstance(shape, dict):
        return {k: _jsonable_shape(v) for k, v in shape.items()}
    return [
        _jsonable_shape(d)
        if isinstance(d, (tuple, list, dict))
        else (None if d is None else int(d))
        for d in shape
    ]


def _read(path: str) -> tuple[dict[str, Any], str, Any]:
    """(config, a weights file path, a cleanup callable)."""
    if os.path.isdir(path):
        names = {n: os.path.join(path, n) for n in (CONFIG, METADATA, WEIGHTS)}
        for n, p in names.items():
            if not os.path.exists(p):
                raise errors.NotFoundError(f"{path!r} is not a saved model: it has no {n}")
        with open(names[METADATA]) as f:
            metadata_text = f.read()
        with open(names[CONFIG]) as f:
            config_text = f.read()
        return _parse(path, metadata_text, config_text), names[WEIGHTS], lambda: None
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise errors.DataLossError(f"{path!r} is not a .keras file (not a zip archive)") from e
    with archive:
        members = set(archive.namelist())
        for n in (CONFIG, METADATA, WEIGHTS):
            if n not in members:
                raise errors.DataLossError(f"{path!r} is not a saved model: it has no {n}")
        config = _parse(
            path, archive.read(METADATA).decode("utf-8"), archive.read(CONFIG).decode("utf-8")
        )
        work = tempfile.mkdtemp(prefix=".psflow-load-")
        archive.extract(WEIGHTS, work)
    return config, os.path.join(work, WEIGHTS), lambda: shutil.rmtree(work, ignore_errors=True)


def _parse(path: str, metadata_text: str, config_text: str) -> dict[str, Any]:
    try:
        metadata = json.loads(metadata_text)
        config = json.loads(config_text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.DataLossError(f"{path!r}: corrupt model file, invalid JSON ({e})") from e
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise errors.DataLossError(f"{path!r}: not a psflow model file (metadata {metadata!r})")
    if int(metadata.get("version", 0)) > VERSION:
        raise errors.UnimplementedError(
            f"{path!r} was written by a newer psflow (format version {metadata['version']}, "
            f"this one reads up to {VERSION})"
        )
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise errors.DataLossError(f"{path!r}: corrupt model file, config has no model entry")
    return config


def load_model(
    filepath: Any, custom_objects: dict[str, Any] | None = None, compile: bool = True
) -> Any:
    """Loads a model written by ``model.save``.

    Args:
        custom_objects: name -> class or function, for custom layers, models
            and Lambda functions that are not registered.
        compile: compile the model as it was saved (when it was compiled).

    Raises:
        NotFoundError: nothing at ``filepath``.
        DataLossError: a file that is not a saved model, or corrupt JSON.
        InvalidArgumentError: an unknown class (named), or weights that do not fit.
    """
    from psflow.io import safetensors

    path = os.fspath(filepath)
    if not os.path.exists(path):
        raise errors.NotFoundError(f"No saved model at {path!r}")
    config, weights_path, cleanup = _read(path)
    try:
        with serialization.custom_object_scope(custom_objects):
            model = serialization.deserialize_keras_object(config["model"], what="model")
            _build(model, (config.get("build_config") or {}).get("input_shape"))
            loaded = safetensors.load_file(weights_path)
            compile_config = config.get("compile_config")
            if compile and compile_config:
                model.compile(**_compile_arguments(compile_config))
    finally:
        cleanup()
    arrays = [loaded[k] for k in sorted(loaded)]
    model.set_weights(arrays)
    return model


def _compile_arguments(config: dict[str, Any]) -> dict[str, Any]:
    """``compile``'s arguments from a saved compile config (loss objects rebuilt)."""
    from psflow.keras import losses as losses_lib

    def loss_from(value: Any) -> Any:
        if isinstance(value, dict) and set(value) == {"class_name", "config"}:
            cls = getattr(losses_lib, str(value["class_name"]), None)
            if not (isinstance(cls, type) and issubclass(cls, losses_lib.Loss)):
                raise errors.InvalidArgumentError(
                    f"Unknown loss class {value['class_name']!r} in the saved compile config"
                )
            return cls.from_config(value["config"])
        return value

    out = dict(config)
    loss = out.get("loss")
    if isinstance(loss, dict) and set(loss) != {"class_name", "config"}:
        out["loss"] = {k: loss_from(v) for k, v in loss.items()}  # per output
    elif isinstance(loss, list):
        out["loss"] = [loss_from(v) for v in loss]
    else:
        out["loss"] = loss_from(loss)
    return out


def _build(model: Any, input_shape: Any) -> None:
    """Creates the variables of a model that its config alone did not build."""
    if model.built and model.weights:
        return
    if input_shape is None:
        if model.built:
            return
        raise errors.FailedPreconditionError(
            f"{model.name}: the saved model records no input shape, so its weights cannot be "
            "created; build it before saving"
        )
    from psflow.framework.tensor import convert_to_tensor
    from psflow.keras.engine.keras_tensor import is_shape, map_shapes

    def zeros(shape: Any) -> Any:
        return convert_to_tensor(np.zeros([1 if d is None else d for d in shape], np.float32))

    shapes = tuple(input_shape) if is_shape(input_shape) else input_shape
    with model._strategy_scope():
        model(map_shapes(zeros, shapes), training=False)  # subclassed models build by calling
