"""``psflow.train.Checkpoint`` behaves as ``tf.train.Checkpoint`` (issue 29, items 1-5).

Each behaviour is TensorFlow's documented one; the reference is a model that
keeps training uninterrupted (values compared exactly) or the path names
TensorFlow writes.  All in one process, no cluster (the embedded parameter
server for the PS cases): the restart-and-resume runs with real processes are
in ``test_checkpoint_resume_processes.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.io.safetensors import load_file, save_file
from tests.conftest import ROOT, child_env

X = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
Y = np.random.default_rng(1).normal(size=(8, 1)).astype("float32")


def _model(**kwargs) -> pf.keras.Sequential:
    return pf.keras.Sequential(
        [pf.keras.layers.Dense(3, activation="relu", **kwargs), pf.keras.layers.Dense(1)]
    )


def _step(model, optimizer) -> None:
    with pf.GradientTape() as tape:
        loss = pf.reduce_mean(pf.square(model(X) - Y))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def _trained(steps: int = 3):
    model, opt = _model(), pf.keras.optimizers.Adam(0.05)
    for _ in range(steps):
        _step(model, opt)
    return model, opt


def _equal(a, b) -> None:
    for x, y in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_array_equal(x, y)


# -- 1. deferred restoration -----------------------------------------------------------------


def test_an_unbuilt_model_gets_the_values_when_its_first_call_builds_it(tmp_path):
    a, _ = _trained()
    path = pf.train.Checkpoint(model=a).save(str(tmp_path / "ckpt"))
    b = _model()
    status = pf.train.Checkpoint(model=b).restore(path)
    assert not b.built
    status.assert_existing_objects_matched()  # nothing exists yet that lacks a value
    with pytest.raises(errors.CheckpointMismatchError, match="layer_with_weights-0/kernel") as e:
        status.assert_consumed()  # four values wait for their variables
    assert isinstance(e.value, AssertionError)  # what TensorFlow raises
    b(X)  # builds: the weights are made and take the saved values
    _equal(a, b)
    assert status.assert_consumed() is status  # the same status, asked again


def test_optimizer_slots_wait_for_the_first_update_then_training_continues_exactly(tmp_path):
    a, opt_a = _trained()
    path = pf.train.Checkpoint(model=a, optimizer=opt_a).save(str(tmp_path / "ckpt"))
    b, opt_b = _model(), pf.keras.optimizers.Adam(0.05)
    status = pf.train.Checkpoint(model=b, optimizer=opt_b).restore(path)
    assert int(opt_b.iterations) == 3
    b(X)
    status.assert_existing_objects_matched()
    with pytest.raises(errors.CheckpointMismatchError, match="slot"):
        status.assert_consumed()  # Adam's m and v wait for apply_gradients
    for _ in range(2):  # the reference keeps training; the restored copy resumes
        _step(a, opt_a)
        _step(b, opt_b)
    _equal(a, b)
    status.assert_consumed()


def test_fit_resumes_a_compiled_unbuilt_model_on_its_first_batch(tmp_path):
    def compiled():
        m = _model()
        m.compile(optimizer=pf.keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        return m

    a = compiled()
    a.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    path = pf.train.Checkpoint(model=a).save(str(tmp_path / "ckpt"))
    b = compiled()
    status = pf.train.Checkpoint(model=b).restore(path)
    a.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    b.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _equal(a, b)  # weights and momentum slots restored before the first update
    assert int(b.optimizer.iterations) == int(a.optimizer.iterations) == 6
    status.assert_consumed()


def test_a_model_compiled_after_restore_gets_its_optimizer_state(tmp_path):
    a = _model()
    a.compile(optimizer=pf.keras.optimizers.SGD(0.1), loss="mse")
    a.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = pf.train.Checkpoint(model=a).save(str(tmp_path / "ckpt"))
    b = _model()
    status = pf.train.Checkpoint(model=b).restore(path)
    b.compile(optimizer=pf.keras.optimizers.SGD(0.1), loss="mse")
    assert int(b.optimizer.iterations) == 2
    b(X)
    status.assert_consumed()


def test_objects_without_a_saved_value_fail_assert_existing_objects_matched(tmp_path):
    a, _ = _trained()
    path = pf.train.Checkpoint(model=a).save(str(tmp_path / "ckpt"))
    b = _model()
    b(X)
    extra = pf.Variable([1.0, 2.0])
    status = pf.train.Checkpoint(model=b, extra=extra).restore(path)
    with pytest.raises(errors.CheckpointMismatchError, match="extra"):
        status.assert_existing_objects_matched()
    with pytest.raises(errors.CheckpointMismatchError, match="extra"):
        status.assert_consumed()
    assert status.expect_partial() is status
    _equal(a, b)  # what matched was restored
    np.testing.assert_array_equal(extra.numpy(), [1.0, 2.0])


def test_a_saved_value_of_another_shape_is_refused_by_path_and_changes_nothing(tmp_path):
    a, _ = _trained()
    path = pf.train.Checkpoint(model=a).save(str(tmp_path / "ckpt"))
    b = pf.keras.Sequential([pf.keras.layers.Dense(3), pf.keras.layers.Dense(2)])
    b(X)
    before = b.get_weights()
    with pytest.raises(
        errors.InvalidArgumentError, match=r"layer_with_weights-1/(kernel|bias) has shape"
    ):
        pf.train.Checkpoint(model=b).restore(path)
    for x, y in zip(before, b.get_weights()):
        np.testing.assert_array_equal(x, y)


def test_a_refused_restore_leaves_no_value_waiting_for_an_unbuilt_model(tmp_path):
    a, _ = _trained()
    path = pf.train.Checkpoint(model=a, v=pf.Variable([1.0, 2.0])).save(str(tmp_path / "ckpt"))
    b = _model()
    with pytest.raises(errors.InvalidArgumentError, match=r"\bv has shape \[2\]"):
        pf.train.Checkpoint(model=b, v=pf.Variable([0.0, 0.0, 0.0])).restore(path)
    b(X)  # builds after the refused restore: its own initial values, none of the checkpoint's
    assert not np.array_equal(b.get_weights()[0], a.get_weights()[0])


# -- 2. matched by object path ---------------------------------------------------------------


def test_values_are_keyed_by_tensorflow_object_paths(tmp_path):
    a, opt = _trained()
    path = pf.train.Checkpoint(model=a, optimizer=opt).save(str(tmp_path / "ckpt"))
    keys = set(load_file(os.path.join(path, "local.safetensors")))
    assert "model/layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert "model/layer_with_weights-1/bias/.ATTRIBUTES/VARIABLE_VALUE" in keys
    slot = (
        "model/layer_with_weights-0/kernel/.OPTIMIZER_SLOT/optimizer/{}/.ATTRIBUTES/VARIABLE_VALUE"
    )
    assert {slot.format(s) for s in opt.rule.slot_names} <= keys
    assert not any("dense" in k for k in keys)  # no variable name in any key


def test_a_second_model_built_in_the_same_process_restores_the_first(tmp_path):
    a, opt_a = _trained()
    path = pf.train.Checkpoint(model=a, optimizer=opt_a).save(str(tmp_path / "ckpt"))
    b, opt_b = _model(), pf.keras.optimizers.Adam(0.05)
    b(X)
    assert [w.name for w in a.weights] != [w.name for w in b.weights]  # dense_2, dense_3...
    pf.train.Checkpoint(model=b, optimizer=opt_b).restore(path)
    _equal(a, b)
    _step(a, opt_a)
    _step(b, opt_b)
    _equal(a, b)


def test_a_first_format_checkpoint_keyed_by_variable_name_still_restores(tmp_path):
    a, _ = _trained()
    path = tmp_path / "old"
    path.mkdir()
    tensors = {f"v/model/{w.name}": np.asarray(w.numpy()) for w in a.weights}
    checksums = save_file(str(path / "local.safetensors"), tensors)
    manifest = {
        "format": "psflow.checkpoint.v1",
        "step": 0,
        "scalars": {},
        "ps": [],
        "ps_variables": {},
        "optimizers": {},
        "external": {},
        "local": {"file": "local.safetensors", "checksums": checksums},
    }
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    b = _model()
    b(X)
    for wa, wb in zip(a.weights, b.weights):  # the old format needs the same names
        wb._name = wa.name
    pf.train.Checkpoint(model=b).restore(str(path)).assert_consumed()
    _equal(a, b)


def test_a_second_model_under_the_embedded_parameter_server_restores_the_first(tmp_path):
    strategy = pf.distribute.ParameterServerStrategy()
    with strategy.scope():
        a = _model(input_shape=(4,))
        a.compile(optimizer=pf.keras.optimizers.SGD(0.1), loss="mse")
    a.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = pf.train.Checkpoint(model=a).save(str(tmp_path / "ckpt"))
    with strategy.scope():
        b = _model(input_shape=(4,))  # other PS variable names
        b.compile(optimizer=pf.keras.optimizers.SGD(0.1), loss="mse")
        c = _model()  # unbuilt: restored when it builds
        c.compile(optimizer=pf.keras.optimizers.SGD(0.1), loss="mse")
    pf.train.Checkpoint(model=b).restore(path).assert_consumed()
    _equal(a, b)
    status = pf.train.Checkpoint(model=c).restore(path)
    c(X)
    _equal(a, c)
    status.assert_consumed()


# -- 3. save() records itself; write() does not ----------------------------------------------


def test_save_records_the_checkpoint_for_latest_checkpoint_and_write_does_not(tmp_path):
    v = pf.Variable([1.0])
    ckpt = pf.train.Checkpoint(v=v)
    written = ckpt.write(str(tmp_path / "w" / "manual"))
    assert pf.train.latest_checkpoint(str(tmp_path / "w")) is None
    first = ckpt.save(str(tmp_path / "s" / "ckpt"))
    second = ckpt.save(str(tmp_path / "s" / "ckpt"))
    assert first.endswith("ckpt-1") and second.endswith("ckpt-2")
    assert pf.train.latest_checkpoint(str(tmp_path / "s")) == os.path.abspath(second)
    assert written.endswith("manual") and int(ckpt.save_counter) == 2


# -- 4. save_counter is saved and restored ---------------------------------------------------

RESAVE = textwrap.dedent(
    """
    import sys
    import psflow as pf
    v = pf.Variable([0.0, 0.0])
    ckpt = pf.train.Checkpoint(v=v)
    ckpt.restore(pf.train.latest_checkpoint(sys.argv[1])).assert_consumed()
    print("COUNTER", int(ckpt.save_counter), v.numpy().tolist())
    print("SAVED", ckpt.save(sys.argv[1] + "/ckpt"))
    """
)


def test_a_new_process_restoring_ckpt_1_saves_ckpt_2(tmp_path):
    ckpt = pf.train.Checkpoint(v=pf.Variable([3.0, 4.0]))
    ckpt.save(str(tmp_path / "ckpt"))
    out = subprocess.run(
        [sys.executable, "-c", RESAVE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "COUNTER 1 [3.0, 4.0]" in out.stdout
    assert out.stdout.strip().endswith(str(tmp_path / "ckpt-2"))
    assert pf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-2")


# -- 5. restore(None); iterators -------------------------------------------------------------


def test_restore_none_restores_nothing_and_says_so(tmp_path):
    v = pf.Variable([5.0])
    manager = pf.train.CheckpointManager(pf.train.Checkpoint(v=v), str(tmp_path), max_to_keep=1)
    status = manager._checkpoint.restore(manager.latest_checkpoint)  # the first run: None
    assert status.expect_partial() is status
    with pytest.raises(errors.CheckpointMismatchError, match="save_path=None"):
        status.assert_consumed()
    with pytest.raises(errors.CheckpointMismatchError):
        status.assert_existing_objects_matched()
    np.testing.assert_array_equal(v.numpy(), [5.0])


def test_an_iterator_resumes_after_the_elements_it_had_given(tmp_path):
    ds = pf.data.Dataset.range(20).shuffle(20, seed=4).batch(3)
    it = iter(ds)
    seen = [next(it).numpy().tolist() for _ in range(2)]
    path = pf.train.Checkpoint(iterator=it).save(str(tmp_path / "ckpt"))
    rest = [b.numpy().tolist() for b in it]
    # another pipeline object built the same way, as a restarted program builds it
    fresh = iter(pf.data.Dataset.range(20).shuffle(20, seed=4).batch(3))
    pf.train.Checkpoint(iterator=fresh).restore(path).assert_consumed()
    assert [b.numpy().tolist() for b in fresh] == rest
    assert sorted(x for b in seen + rest for x in b) == list(range(20))


@pytest.mark.parametrize(
    "make, needle",
    [
        (
            lambda: pf.data.Dataset.from_generator(lambda: iter(range(3)), output_types="int64"),
            "from_generator",
        ),
        (lambda: pf.data.Dataset.range(5).shuffle(5), "shuffle.*without a seed"),
    ],
)
def test_an_iterator_that_cannot_be_saved_is_refused_by_name_at_save(tmp_path, make, needle):
    it = iter(make())
    next(it)
    ckpt = pf.train.Checkpoint(iterator=it, v=pf.Variable(1.0))
    with pytest.raises(errors.FailedPreconditionError, match=f"'iterator'.*{needle}"):
        ckpt.save(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt-1").exists()
    assert pf.train.latest_checkpoint(str(tmp_path)) is None


# -- dynamic embedding tables: deferred too, and restored by table name ----------------------


def _table_model(**kwargs) -> pf.keras.Sequential:
    return pf.keras.Sequential(
        [
            pf.keras.layers.DynamicEmbedding(4, seed=7, **kwargs),  # built by its first call
            pf.keras.layers.Flatten(),
            pf.keras.layers.Dense(1),
        ]
    )


def test_a_dynamic_table_built_after_restore_gets_its_rows_and_slots(tmp_path):
    from tests.test_dynamic_table_keras import _custom_loop, _data, _table_state

    ids, y = _data()
    a, opt_a = _table_model(table_name="t"), pf.keras.optimizers.Adagrad(0.1)
    _custom_loop(a, opt_a, ids, y, 8, 3)
    path = pf.train.Checkpoint(model=a, optimizer=opt_a).save(str(tmp_path / "ckpt"))
    b, opt_b = _table_model(table_name="t"), pf.keras.optimizers.Adagrad(0.1)
    status = pf.train.Checkpoint(model=b, optimizer=opt_b).restore(path)
    assert not b.built
    _custom_loop(a, opt_a, ids[24:], y[24:], 8, 2)
    _custom_loop(b, opt_b, ids[24:], y[24:], 8, 2)
    _equal(a, b)
    saved, restored = _table_state(a), _table_state(b)
    for key in saved:
        np.testing.assert_array_equal(restored[key], saved[key], err_msg=key)
    status.assert_consumed()


def test_a_table_of_another_name_is_refused_by_name_not_silently_skipped(tmp_path):
    from tests.test_dynamic_table_keras import _custom_loop, _data

    ids, y = _data()
    a, opt = _table_model(table_name="first"), pf.keras.optimizers.SGD(0.1)
    _custom_loop(a, opt, ids, y, 8, 1)
    path = pf.train.Checkpoint(model=a).save(str(tmp_path / "ckpt"))
    b = _table_model(table_name="second")
    b(ids[:2])
    with pytest.raises(errors.UnimplementedError, match=r"saved as 'first'.*table_name='first'"):
        pf.train.Checkpoint(model=b).restore(path)
