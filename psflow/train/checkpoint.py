"""``psflow.train.Checkpoint``: save and restore models, optimizers and variables.

A checkpoint is a directory (``<prefix>-<n>``):

* values are named by object path (``model/layer_with_weights-0/kernel``, see
  :mod:`psflow.train.object_graph` and ``docs/checkpoints.md``), so they restore
  into any program whose objects have the same structure; values whose objects
  do not exist yet wait for them (:mod:`psflow.train.restore`);
* variables held by parameter servers are written by their PS tasks, each its
  own shard files (``ps-<i>.manifest.json`` and a safetensors file, values and
  optimizer slots, sha256-checksummed);
* variables held in this process (default or mirrored strategy) and local
  optimizer slots go to ``local.safetensors``;
* state no variable holds (dynamic embedding tables, :class:`ExternalState`)
  is written by its owner into ``external-<i>/``;
* ``checkpoint.json``, written last and atomically, holds the object graph and
  names everything with its checksums — a checkpoint exists only once it is
  there, so a crash while saving leaves the previous one as the latest
  (:mod:`psflow.train.writer`).

Restoring verifies every checksum. When the parameter servers are laid out
differently than at save time (another number of tasks, another number of
shards of a partitioned variable), or their variables have other names, the
shards are rewritten for the current layout first (see
:mod:`psflow.train.reshard`) — TensorFlow cannot re-split shards.

Example:
    >>> import psflow as pf, tempfile, os
    >>> v = pf.Variable([1.0, 2.0])
    >>> ckpt = pf.train.Checkpoint(v=v)
    >>> path = ckpt.save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    >>> _ = v.assign([0.0, 0.0])
    >>> _ = ckpt.restore(path)
    >>> v.numpy().tolist()
    [1.0, 2.0]
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from psflow import errors
from psflow.train.trackable import Kind, Trackable
from psflow.train.writer import file_sha256

FORMAT = "psflow.checkpoint.v2"  # v2: values keyed by object path
_FORMAT_V1 = "psflow.checkpoint.v1"  # keyed by variable name: still restored (legacy)
MANIFEST = "checkpoint.json"


class ExternalState(Trackable):
    """A tracked object whose state is no array this process holds (a dynamic
    embedding table on the parameter servers): it writes and reads its own
    files in the directory a checkpoint gives it, before the checkpoint commits."""

    checkpoint_kind = Kind.EXTERNAL

    def save_external(self, directory: str) -> None:
        """Writes the state under ``directory`` (which may not exist yet)."""
        raise NotImplementedError(f"{type(self).__name__} does not define save_external")

    def restore_external(self, directory: str) -> None:
        """Replaces the state with the one :meth:`save_external` wrote there."""
        raise NotImplementedError(f"{type(self).__name__} does not define restore_external")

    @property
    def external_name(self) -> str | None:
        """The name the state is saved under and restored by (None: not named)."""
        return None


class Checkpoint(Trackable):
    """Groups objects to save and restore together (TensorFlow's ``tf.train.Checkpoint``).

    Values are matched by object path (``model/layer_with_weights-0/kernel``,
    see :mod:`psflow.train.object_graph`), not by variable name; values whose
    objects do not exist yet (an unbuilt model, slots before the first update)
    are given to them when they are created (see :mod:`psflow.train.restore`).

    Args:
        root: an object saved under ``"root"``.
        **kwargs: models, layers, optimizers, variables, ``psflow.data``
            iterators or plain numbers, by name.

    Raises:
        InvalidArgumentError: an object a checkpoint cannot track, naming it.
    """

    def __init__(self, root: Any = None, **kwargs: Any) -> None:
        from psflow.framework.variable import local_variable
        from psflow.train import object_graph

        self._objects = dict(kwargs)
        if root is not None:
            self._objects["root"] = root
        for attr, obj in self._objects.items():
            if object_graph.kind_of(obj) is None:
                raise errors.InvalidArgumentError(
                    f"Checkpoint cannot track {attr}={type(obj).__name__}: give models, layers, "
                    "optimizers, variables, iterators, plain numbers or a "
                    "psflow.train.trackable.Trackable"
                )
        # never a strategy's variable (a PS variable under ParameterServerStrategy)
        self._save_counter = local_variable(0, name="save_counter", dtype="int64")

    def checkpoint_children(self) -> dict[str, Any]:
        """The objects given, by name (the checkpoint's edges)."""
        return dict(self._objects)

    @property
    def save_counter(self) -> Any:
        """How many times :meth:`save` ran (restored with a checkpoint), an int64 variable."""
        return self._save_counter

    @save_counter.setter
    def save_counter(self, value: Any) -> None:
        self._save_counter.assign(int(value))

    # -- saving ------------------------------------------------------------------------
    def save(
        self, file_prefix: str, step: int | None = None, extra: dict[str, Any] | None = None
    ) -> str:
        """Writes ``<file_prefix>-<n>`` (n: :attr:`save_counter`, incremented first) and
        records it in the directory's ``checkpoint`` state file, so that
        :func:`latest_checkpoint` finds it; returns its path."""
        from psflow.train.manager import record_latest

        self.save_counter = int(self._save_counter) + 1
        path = self.write(f"{os.fspath(file_prefix)}-{int(self._save_counter)}", step, extra)
        record_latest(path)
        return path

    def write(self, path: str, step: int | None = None, extra: dict[str, Any] | None = None) -> str:
        """Writes a checkpoint at ``path`` (a new directory); returns ``path``.

        Unlike :meth:`save`, neither counts nor records it.

        Raises:
            AlreadyExistsError: a complete checkpoint is already at ``path``.
            FailedPreconditionError: a tracked iterator whose position cannot be
                saved (nothing is written).
        """
        from psflow.train import writer

        path = os.fspath(path)
        if os.path.exists(os.path.join(path, MANIFEST)):
            raise errors.AlreadyExistsError(f"A checkpoint already exists at {path}")
        return writer.write(self, path, int(step or 0), int(self._save_counter), extra or {})

    # -- restoring -----------------------------------------------------------------------
    def restore(self, save_path: str | None) -> Any:
        """Restores every tracked object's state from ``save_path``; returns a status.

        Values of objects that do not exist yet wait for them (deferred
        restoration); the status's ``assert_consumed()`` tells whether some
        still wait.  ``save_path=None`` (no checkpoint yet) restores nothing.

        Raises:
            NotFoundError: no complete checkpoint at ``save_path``.
            DataLossError: a checksum does not match (nothing is half-restored
                on this process's side; the parameter servers verify theirs before
                replacing anything).
            InvalidArgumentError: a saved value's shape differs from its object's.
        """
        from psflow.train import legacy
        from psflow.train import restore as restore_lib

        if save_path is None:
            return restore_lib.InitializationOnlyStatus()
        save_path = os.fspath(save_path)
        manifest = read_manifest(save_path)
        for entry in manifest.get("ps", []):
            m = os.path.join(save_path, entry["manifest"])
            if not os.path.exists(m) or file_sha256(m) != entry["sha256"]:
                raise errors.DataLossError(f"{m} is missing or does not match its checksum")
        if manifest["format"] == legacy.FORMAT_V1:
            return legacy.restore(self._objects, save_path, manifest, restore_ps)
        restoration = restore_lib.Restoration(save_path, manifest)
        restoration.run(self)
        self.save_counter = int(manifest.get("save_counter", 0))
        return restore_lib.CheckpointLoadStatus(restoration, self)

    read = restore


def read_manifest(path: str) -> dict[str, Any]:
    """The ``checkpoint.json`` of a checkpoint directory.

    Raises:
        NotFoundError: there is none (no checkpoint, or an incomplete one).
        DataLossError: it is not a psflow checkpoint manifest.
    """
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise errors.NotFoundError(f"No complete checkpoint at {path} (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.DataLossError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, _FORMAT_V1):
        raise errors.DataLossError(f"{file} is not a {FORMAT} manifest")
    return manifest


def restore_ps(session: Any, path: str, manifest: dict[str, Any], sources: dict[str, str]) -> None:
    """Restores every variable ``session`` knows on the parameter servers from ``path``.

    ``sources`` maps current variable names (without ``/part_<i>``) to their
    names in the checkpoint where they differ; shards are rewritten when names
    or the layout of tasks and shards changed since the save.
    """
    from psflow.io import manifest as mf
    from psflow.train import reshard

    layout = session.handles_by_ps()
    saved: set[str] = set()
    for entry in manifest.get("ps", []):
        saved |= {
            e["name"] for e in mf.read_manifest(os.path.join(path, entry["manifest"]))["variables"]
        }
    renamed = {k: v for k, v in sources.items() if k != v}
    wanted = {h.key: h for hs in layout.values() for h in hs}
    if not renamed and all(name in saved for name in wanted):
        session.restore(path, {ps: [h.key for h in hs] for ps, hs in layout.items()})
        return
    rewritten = reshard.rewrite(
        path,
        {ps: [(h.key, h.shape_tuple) for h in hs] for ps, hs in layout.items()},
        int(manifest.get("step", 0)),
        sources=renamed,
    )
    try:
        session.restore(rewritten)
    finally:
        shutil.rmtree(rewritten, ignore_errors=True)


def latest_checkpoint(checkpoint_dir: str) -> str | None:
    """The newest complete checkpoint recorded in ``checkpoint_dir``, or None.

    Recorded by a :class:`CheckpointManager` (a checkpoint directory) or by
    ``keras.callbacks.ModelCheckpoint`` (a weights file for ``model.load_weights``).
    """
    from psflow.train.manager import read_state

    state = read_state(os.fspath(checkpoint_dir))
    return state["latest"] if state else None
