"""``psflow.summary`` (TensorFlow's ``tf.summary``): event files read back with TensorBoard's
own reader, the default writer and step per thread, and the errors of bad calls."""

from __future__ import annotations

import pathlib
import threading

import numpy as np
import pytest

import psflow as pf

pytest.importorskip("tensorboard")


def _read(directory: pathlib.Path) -> dict[str, list[tuple[int, np.ndarray]]]:
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    acc = event_accumulator.EventAccumulator(str(directory), size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }


def test_scalars_histograms_and_text_load_in_tensorboard(tmp_path: pathlib.Path) -> None:
    writer = pf.summary.create_file_writer(str(tmp_path))
    data = np.random.default_rng(0).normal(size=500).astype(np.float32)
    with writer.as_default():
        for step in range(3):
            assert pf.summary.scalar("loss", pf.constant(1.0 / (step + 1)), step=step)
        assert pf.summary.histogram("weights", pf.constant(data), step=7, buckets=10)
        assert pf.summary.text("note", "hello", step=2)
        pf.summary.flush()
    events = _read(tmp_path)
    assert [(s, float(v)) for s, v in events["loss"]] == [
        (0, 1.0),
        (1, 0.5),
        (2, pytest.approx(1 / 3)),
    ]
    [(step, hist)] = events["weights"]  # rows of (left edge, right edge, count)
    assert step == 7 and hist.shape == (10, 3)
    assert hist[:, 2].sum() == 500
    assert hist[0, 0] == pytest.approx(data.min()) and hist[-1, 1] == pytest.approx(data.max())
    [(step, note)] = events["note"]
    assert step == 2 and note.item() == b"hello"


def test_the_default_step_comes_from_as_default_or_set_step(tmp_path: pathlib.Path) -> None:
    writer = pf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=5):
        pf.summary.scalar("a", 1.0)
        pf.summary.experimental.set_step(pf.constant(9, dtype="int64"))
        pf.summary.scalar("b", 2.0)
        pf.summary.scalar("c", 3.0, step=11)  # an explicit step wins
    assert pf.summary.experimental.get_step() is None  # as_default(step=) restores the step
    pf.summary.experimental.set_step(4)
    try:
        with writer.as_default():
            pf.summary.scalar("d", 4.0)
    finally:
        pf.summary.experimental.set_step(None)
    steps = {tag: [s for s, _ in v] for tag, v in _read(tmp_path).items()}
    assert steps == {"a": [5], "b": [9], "c": [11], "d": [4]}


def test_without_a_default_writer_or_when_not_recording_nothing_is_written(
    tmp_path: pathlib.Path,
) -> None:
    assert pf.summary.scalar("loss", 1.0, step=0) is False
    writer = pf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=0):
        with pf.summary.record_if(False):
            assert pf.summary.scalar("off", 1.0) is False
        assert pf.summary.should_record_summaries()
        seen = []  # the default writer belongs to the thread that entered it
        t = threading.Thread(target=lambda: seen.append(pf.summary.scalar("other", 1.0, step=0)))
        t.start()
        t.join(10)
        assert seen == [False]
    assert pf.summary.should_record_summaries() is False
    with pf.summary.create_noop_writer().as_default(step=0):
        assert pf.summary.scalar("noop", 1.0)
    assert _read(tmp_path) == {}


def test_bad_calls_raise_typed_errors_naming_the_value(tmp_path: pathlib.Path) -> None:
    writer = pf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        with pytest.raises(pf.errors.InvalidArgumentError, match="No step"):
            pf.summary.scalar("loss", 1.0)
        with pytest.raises(pf.errors.InvalidArgumentError, match=r"'loss'.*scalar"):
            pf.summary.scalar("loss", [1.0, 2.0], step=0)
        with pytest.raises(pf.errors.InvalidArgumentError, match=r"'h'.*numeric"):
            pf.summary.histogram("h", ["a"], step=0)
        with pytest.raises(pf.errors.InvalidArgumentError, match=r"integer.*1\.5"):
            pf.summary.scalar("loss", 1.0, step=1.5)
    writer.close()
    with (
        writer.as_default(step=0),
        pytest.raises(pf.errors.FailedPreconditionError, match="closed"),
    ):
        pf.summary.scalar("late", 1.0)
    assert _read(tmp_path) == {}


def test_summary_calls_without_a_writer_need_no_tensorboard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    for module in ("tensorboard.plugins.scalar", "tensorboard.plugins.scalar.summary_v2"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    assert pf.summary.scalar("loss", 1.0, step=0) is False
    for module in ("tensorboard.compat.proto", "tensorboard.compat.proto.event_pb2"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(pf.errors.FailedPreconditionError, match="pip install"):
        pf.summary.create_file_writer("/nonexistent-never-created")
