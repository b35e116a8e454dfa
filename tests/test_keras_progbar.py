"""What ``fit`` and ``evaluate`` print: Keras 2's progress lines, byte for byte except times."""

from __future__ import annotations

import io
import re
import sys
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import keras
from psflow.keras.utils import Progbar
from psflow.keras.utils.progbar import format_time_per_unit, format_value

TIME = r"\d+(?:s|ms|us)"
BAR_DONE = r"\[={30}\]"
NUM = r"-?\d+\.\d{4}(?:e[+-]\d+)?"


class FakeTTY(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _model() -> keras.Sequential:
    pf.random.set_seed(0)
    model = keras.Sequential([keras.layers.Dense(1, input_shape=(2,))])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    return model


X = np.arange(12, dtype=np.float32).reshape(6, 2) / 10
Y = np.ones((6, 1), np.float32)


@pytest.fixture(autouse=True)
def _default_progbar_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PSFLOW_PROGBAR", raising=False)


def test_one_epoch_prints_one_line_without_a_header(capsys: Any) -> None:
    hist = _model().fit(X, Y, batch_size=3, epochs=1)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 1 and out.endswith("\n")
    m = re.fullmatch(rf"2/2 {BAR_DONE} - \d+s {TIME}/step - loss: ({NUM}) - mae: ({NUM})", lines[0])
    assert m, lines[0]
    assert m.group(1) == f"{hist.history['loss'][0]:.4f}"
    assert m.group(2) == f"{hist.history['mae'][0]:.4f}"


def test_several_epochs_print_headers_and_one_line_each(capsys: Any) -> None:
    hist = _model().fit(X, Y, batch_size=4, epochs=3, verbose="auto")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0::2] == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    for i, line in enumerate(lines[1::2]):
        assert re.fullmatch(rf"2/2 {BAR_DONE} - \d+s {TIME}/step - loss: {NUM} - mae: {NUM}", line)
        assert f"loss: {hist.history['loss'][i]:.4f}" in line


def test_validation_results_join_the_epoch_line(capsys: Any) -> None:
    _model().fit(X, Y, batch_size=6, epochs=1, validation_data=(X, Y))
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        rf"1/1 {BAR_DONE} - \d+s {TIME}/step - loss: {NUM} - mae: {NUM}"
        rf" - val_loss: {NUM} - val_mae: {NUM}",
        line,
    ), line


def test_verbose_zero_prints_nothing(capsys: Any) -> None:
    model = _model()
    model.fit(X, Y, epochs=3, verbose=0)
    model.evaluate(X, Y, verbose=0)
    model.predict(X, verbose=0)
    assert capsys.readouterr().out == ""


def test_verbose_two_prints_keras_2_epoch_lines(capsys: Any) -> None:
    _model().fit(X, Y, batch_size=2, epochs=2, verbose=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2"
    for line in lines[1::2]:
        assert re.fullmatch(
            rf"3/3 - \d+s - loss: {NUM} - mae: {NUM} - {TIME}/epoch - {TIME}/step", line
        ), line


def test_verbose_two_on_a_terminal_does_not_redraw(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stdout", tty)
    _model().fit(X, Y, batch_size=2, epochs=1, verbose=2)
    assert "\r" not in tty.getvalue()
    assert re.fullmatch(
        rf"3/3 - \d+s - loss: {NUM} - mae: {NUM} - {TIME}/epoch - {TIME}/step\n", tty.getvalue()
    )


def test_evaluate_prints_one_line(capsys: Any) -> None:
    loss, mae = _model().evaluate(X, Y, batch_size=4)
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"2/2 {BAR_DONE} - \d+s {TIME}/step - loss: {NUM} - mae: {NUM}", line)
    assert f"loss: {loss:.4f} - mae: {mae:.4f}" in line


def test_unknown_step_count_is_filled_in_at_the_end(capsys: Any) -> None:
    def batches() -> Any:
        yield X[:3], Y[:3]
        yield X[3:], Y[3:]

    _model().fit(batches(), epochs=1)
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"2/2 {BAR_DONE} - \d+s {TIME}/step - loss: {NUM} - mae: {NUM}", line)


def test_interactive_bar_redraws_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stdout", tty)
    _model().fit(X, Y, batch_size=2, epochs=2)
    out = tty.getvalue()
    assert out.startswith("Epoch 1/2\n\r1/3 [")
    assert out.count("\n") == 4  # two headers, two finished bars
    frames = out.split("\r")[1:]
    # Per epoch: one frame per batch (the last one still says ETA, as Keras 2's does),
    # then the finished bar over it.
    assert len(frames) == 8
    partial = rf" - ETA: \d+s - loss: {NUM} - mae: {NUM} *"
    assert re.fullmatch(rf"1/3 \[={{9}}>\.{{20}}\]{partial}", frames[0]), frames[0]
    assert re.fullmatch(rf"2/3 \[={{19}}>\.{{10}}\]{partial}", frames[1]), frames[1]
    assert re.fullmatch(rf"3/3 {BAR_DONE}{partial}", frames[2]), frames[2]
    assert re.fullmatch(
        rf"3/3 {BAR_DONE} - \d+s {TIME}/step - loss: {NUM} - mae: {NUM} *\nEpoch 2/2\n", frames[3]
    ), frames[3]
    assert frames[7].endswith("\n") and "Epoch" not in frames[7]


def test_plain_mode_can_be_forced_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stdout", tty)
    monkeypatch.setenv("PSFLOW_PROGBAR", "plain")
    _model().fit(X, Y, batch_size=2, epochs=1)
    assert "\r" not in tty.getvalue() and tty.getvalue().count("\n") == 1


# -- the Progbar itself ----------------------------------------------------------------------


def test_progbar_bar_shapes() -> None:
    stream = FakeTTY()
    bar = Progbar(10, stream=stream, width=10)
    bar.update(0)
    bar.update(3, [("loss", 0.5)])
    bar.update(10, [("loss", 0.25)])
    frames = stream.getvalue().split("\r")[1:]
    assert frames[0].startswith(" 0/10 [..........] - ETA: 0s")
    assert frames[1].startswith(" 3/10 [==>.......] - ETA: ")
    assert frames[1].rstrip().endswith(" - loss: 0.5000")
    assert re.fullmatch(rf"10/10 \[==========\] - \d+s {TIME}/step - loss: 0\.2500 *\n", frames[2])
    bar.update(10, [("loss", 1.0)])  # nothing after the final line
    assert stream.getvalue().count("\n") == 1


def test_progbar_pads_the_target_width_and_handles_an_unknown_target() -> None:
    stream = FakeTTY()
    Progbar(120, stream=stream, width=4).update(7)
    assert stream.getvalue() == "\r  7/120 [....] - ETA: 0s"
    stream = FakeTTY()
    Progbar(None, stream=stream).update(5)
    assert re.fullmatch(rf"\r      5/Unknown - {TIME}/step", stream.getvalue())


def test_progbar_plain_stream_prints_only_the_final_line() -> None:
    stream = io.StringIO()
    bar = Progbar(4, stream=stream)
    for i in range(1, 4):
        bar.update(i, [("loss", 1.0)])
    assert stream.getvalue() == ""
    bar.update(4, [("loss", 1.0)])
    assert re.fullmatch(rf"4/4 {BAR_DONE} - \d+s {TIME}/step - loss: 1\.0000\n", stream.getvalue())


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (15.23449, " 15.2345"),
        (0.5, " 0.5000"),
        (0.0, " 0.0000"),
        (2.5e-4, " 2.5000e-04"),
        (-3.0, " -3.0000"),
    ],
)
def test_value_format(value: float, text: str) -> None:
    assert format_value(value) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(3.4, "3s/step"), (0.0034, "3ms/step"), (5e-5, "50us/step"), (0.0, "0s/step")],
)
def test_time_per_unit_format(seconds: float, text: str) -> None:
    assert format_time_per_unit(seconds) == text
    assert format_time_per_unit(seconds, "epoch") == text.replace("step", "epoch")


def test_predict_prints_keras_progress_line(capsys: Any) -> None:
    model = _model()
    model.predict(X, batch_size=4)  # verbose="auto": the bar, as Keras
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"2/2 {BAR_DONE} - \d+s {TIME}/step", line), line
    model.predict(X, batch_size=2, verbose=2)
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"3/3 - \d+s - {TIME}/epoch - {TIME}/step", line), line


def test_predict_bar_redraws_per_batch_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stdout", tty)
    _model().predict(X, batch_size=2, verbose=1)
    frames = tty.getvalue().split("\r")[1:]
    assert len(frames) == 4 and tty.getvalue().count("\n") == 1
    assert re.fullmatch(r"1/3 \[={9}>\.{20}\] - ETA: \d+s *", frames[0]), frames[0]
    assert re.fullmatch(rf"3/3 {BAR_DONE} - \d+s {TIME}/step *\n", frames[3]), frames[3]
