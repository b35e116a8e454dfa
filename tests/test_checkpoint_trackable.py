"""Checkpoints save any object through :class:`psflow.train.trackable.Trackable`
(no Keras class known to them), and the callbacks modules import in any order."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import psflow as pf
from psflow.errors import InvalidArgumentError
from psflow.train.trackable import Kind, Trackable
from tests.conftest import ROOT, child_env


class Pair(Trackable):
    """A plain object holding two variables and a nested trackable."""

    def __init__(self, inner: Trackable | None = None) -> None:
        self.a = pf.Variable([1.0, 2.0])
        self.b = pf.Variable([3.0])
        self.inner = inner

    def checkpoint_children(self) -> dict:
        out = {"a": self.a, "b": self.b}
        if self.inner is not None:
            out["inner"] = self.inner
        return out


def test_a_trackable_of_our_own_is_saved_by_its_paths_and_restored(tmp_path) -> None:
    saved = Pair(inner=Pair())
    saved.inner.a.assign([7.0, 8.0])
    path = pf.train.Checkpoint(pair=saved).save(str(tmp_path / "ckpt"))
    manifest = pf.train.checkpoint.read_manifest(path)
    text = repr(manifest)
    # named by object path, as TensorFlow names a trackable's values
    assert "pair/inner/a/.ATTRIBUTES/VARIABLE_VALUE" in text
    assert "pair/b/.ATTRIBUTES/VARIABLE_VALUE" in text
    fresh = Pair(inner=Pair())
    pf.train.Checkpoint(pair=fresh).restore(path).assert_consumed()
    np.testing.assert_array_equal(fresh.inner.a.numpy(), [7.0, 8.0])
    np.testing.assert_array_equal(fresh.a.numpy(), [1.0, 2.0])


def test_an_object_that_is_no_trackable_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgumentError, match=r"thing=object.*Trackable"):
        pf.train.Checkpoint(thing=object())


def test_keras_classes_implement_the_protocol() -> None:
    layer = pf.keras.layers.Dense(2)
    layer.build((None, 3))
    assert isinstance(layer, Trackable) and layer.checkpoint_kind is Kind.OBJECT
    assert list(layer.checkpoint_children()) == ["kernel", "bias"]
    optimizer = pf.keras.optimizers.SGD(0.1)
    assert optimizer.checkpoint_kind is Kind.OPTIMIZER and optimizer.checkpoint_children() == {}


_NO_KERAS = """
import os, sys, tempfile
import psflow as pf
from psflow.train.trackable import Trackable

class Box(Trackable):
    def __init__(self):
        self.v = pf.Variable([1.0, 2.0])
    def checkpoint_children(self):
        return {"v": self.v}

path = pf.train.Checkpoint(box=Box()).save(os.path.join(tempfile.mkdtemp(), "c"))
pf.train.Checkpoint(box=Box()).restore(path).assert_consumed()
print(sorted(m for m in sys.modules if m.startswith("psflow.keras")))
"""


def test_saving_and_restoring_imports_no_keras() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _NO_KERAS], capture_output=True, text=True, env=child_env(),
        cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "first",
    [
        "psflow.keras.callbacks_plateau",
        "psflow.keras.callbacks_tensorboard",
        "psflow.keras.callbacks",
    ],
)
def test_each_callbacks_module_imports_first_on_its_own(first: str) -> None:
    code = f"import {first}; from psflow.keras.callbacks import ReduceLROnPlateau, TensorBoard"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), cwd=ROOT,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
