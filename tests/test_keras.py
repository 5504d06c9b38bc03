"""ms.keras.StepHistory against Keras itself: the per-batch logs of fit with
steps_per_execution=1, and the weights of fit with steps_per_execution=N without it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

_rng = np.random.RandomState(0)
X = _rng.randn(64, 4).astype(np.float32)
Y = _rng.randint(0, 3, 64)


def compiled(steps_per_execution):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


class Batches(keras.callbacks.Callback):
    """Keras's own per-batch logs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((batch, float(logs["loss"]), float(logs["accuracy"])))


def fit(model, callbacks):
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)


def test_every_inner_step_as_keras_reports_it_one_step_per_execution(tmp_path):
    one = compiled(1)
    reference = Batches()
    fit(one, [reference])  # 8 batches an epoch, 2 epochs: 16 steps

    fused = compiled(4)
    inner = Batches()
    steps = ms.keras.StepHistory(callbacks=[inner], log_dir=str(tmp_path))
    fit(fused, [steps])
    assert steps.steps == list(range(1, 17))
    assert steps.history["loss"] == [loss for _, loss, _ in reference.seen]
    assert steps.history["accuracy"] == [acc for _, _, acc in reference.seen]
    assert [b for b, _, _ in inner.seen] == list(range(16))  # true indices, every step

    plain = compiled(4)  # the same fit without StepHistory: training unchanged by it
    fit(plain, [])
    for a, b in zip(fused.variables, plain.variables):
        assert np.array_equal(a.numpy(), b.numpy())
    assert "train_step" not in vars(fused)  # the model's own train_step again

    events = [e for path in tmp_path.glob("events.out.tfevents.*")
              for e in tf.compat.v1.train.summary_iterator(str(path))]
    points = sorted((e.step, float(tf.make_ndarray(v.tensor))) for e in events
                    for v in e.summary.value if v.tag == "loss")
    assert points == [(s, l) for s, l in zip(range(1, 17), steps.history["loss"])]


def test_without_callbacks_the_buffer_is_read_before_it_wraps(monkeypatch):
    """Without callbacks or log_dir, StepHistory reads its buffer only before it would
    wrap and at each epoch's end (its per-execution read cost a small model 20 % a step
    at N = 4). A buffer of 6 rows (N = 3), executions of 3 and a last one of 1 step an
    epoch: every step's logs as Keras reports them one step per execution."""
    from multistep.tf2 import keras as keras_lib
    monkeypatch.setattr(keras_lib, "_ROWS", 8)  # rows: the multiple of N = 3 below 8

    def fit_with(model, callbacks):
        model.fit(X, Y, batch_size=4, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)

    reference = Batches()
    fit_with(compiled(1), [reference])  # 16 batches an epoch
    steps = ms.keras.StepHistory()
    fit_with(compiled(3), [steps])
    assert steps._rows == 6
    assert steps.steps == list(range(1, 33))
    assert steps.history["loss"] == [loss for _, loss, _ in reference.seen]
    assert steps.history["accuracy"] == [acc for _, _, acc in reference.seen]


def _scalars(directory, prefix):
    """{tag: [(step, value)]} of the scalars whose tag starts with ``prefix``."""
    out = {}
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag.startswith(prefix):
                    out.setdefault(value.tag, []).append(
                        (event.step, float(tf.make_ndarray(value.tensor))))
    return out


def test_a_tensorboard_callback_in_step_history_writes_every_step_at_its_index(tmp_path):
    """Issue 29: keras.callbacks.TensorBoard(update_freq=1) in StepHistory(callbacks=...)
    wrote all its batch points at step 0 and no epoch scalars. Against the same callback
    on fit(steps_per_execution=1): the same batch_* points (step, value) and epoch_* ones."""
    def board(name):
        return keras.callbacks.TensorBoard(str(tmp_path / name), update_freq=1,
                                           write_steps_per_second=False)

    fit(compiled(1), [board("single")])
    fit(compiled(4), [ms.keras.StepHistory(callbacks=[board("fused")])])
    for prefix in ("batch_", "epoch_"):
        want = _scalars(tmp_path / "single" / "train", prefix)
        assert want and _scalars(tmp_path / "fused" / "train", prefix) == want, prefix
    assert [s for s, _ in want["epoch_loss"]] == [0, 1]
    assert [s for s, _ in _scalars(tmp_path / "single" / "train", "batch_")["batch_loss"]] == \
        list(range(1, 17))


class Losses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


class Counting(keras.Sequential):
    """Counts the traces of its train_step (each trace calls it once from Python)."""

    traces = 0

    def train_step(self, data):
        Counting.traces += 1
        return super().train_step(data)


def test_three_fits_trace_once_and_a_new_steps_per_execution_is_followed():
    """Issue 29: StepHistory cleared the train function at every fit (3 fits, 6 traces),
    and its buffers kept the first fit's N after compile(steps_per_execution=3)."""
    keras.utils.set_random_seed(1)
    model = Counting([keras.Input((4,)), keras.layers.Dense(3)])

    def compile_with(n):
        model.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=n,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    compile_with(4)
    steps = ms.keras.StepHistory()
    per_fit = []
    for _ in range(3):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[steps])
        per_fit.append(Counting.traces)
    assert per_fit[1] == per_fit[2] == per_fit[0] > 0  # traced in the first fit only
    assert "train_step" not in vars(model)  # the model's own between fits
    compile_with(3)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[steps])
    assert Counting.traces > per_fit[-1]  # a new configuration: traced again, once
    assert steps.steps == list(range(1, 33))

    # The reference: the same four fits one step per execution, Keras's own logs.
    keras.utils.set_random_seed(1)
    reference = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    reference.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=1,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seen = Losses()
    for _ in range(4):
        reference.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[seen])
    assert len(seen.losses) == 32
    assert steps.history["loss"] == seen.losses


def test_a_recompile_with_other_metrics_gets_buffers_of_its_own():
    """A second compile with the same N and a metric added: new buffers for the new keys,
    the step numbers continuing; each fit's logs as Keras reports them (the old buffers,
    keyed by the first compile's logs, dropped the accuracy)."""
    def compile_with(model, steps_per_execution, metrics):
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=metrics,
                      steps_per_execution=steps_per_execution,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def run(steps_per_execution, callback_for):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        compile_with(model, steps_per_execution, [])
        fit(model, [callback_for(0)])  # 16 steps, loss only
        compile_with(model, steps_per_execution, ["accuracy"])
        fit(model, [callback_for(1)])  # 16 more, with accuracy

    steps = ms.keras.StepHistory()
    run(4, lambda fit_index: steps)
    seen = [Losses(), Batches()]
    run(1, lambda fit_index: seen[fit_index])
    assert steps.steps == list(range(1, 33))
    assert steps.history["loss"] == seen[0].losses + [loss for _, loss, _ in seen[1].seen]
    assert steps.history["accuracy"] == [acc for _, _, acc in seen[1].seen]


def test_steps_per_execution_auto_is_refused_by_name():
    model = compiled(1)
    model.steps_per_execution = "auto"
    with pytest.raises(TypeError, match="StepHistory needs compile\\(steps_per_execution=N\\) "
                                        "with an int N"):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[ms.keras.StepHistory()])


def test_a_new_step_history_for_each_fit_does_not_retrace():
    """Issue 39, case 7: a new StepHistory per fit retraced and recompiled every fit (0.61
    to 0.66 s a fit against 0.14 s). Now the second takes the first's train function and
    buffers: no trace; each its own steps (1 to 8), as Keras reports them."""
    keras.utils.set_random_seed(1)
    model = Counting([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=4,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    histories, traces = [], []
    for _ in range(2):
        histories.append(ms.keras.StepHistory())
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                  callbacks=[histories[-1]])
        traces.append(Counting.traces)
    assert traces[1] == traces[0] > 0  # traced in the first fit only

    keras.utils.set_random_seed(1)  # the reference: one step per execution, Keras's logs
    reference = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    reference.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=1,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seen = Losses()
    for _ in range(2):
        reference.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[seen])
    for i, history in enumerate(histories):
        assert history.steps == list(range(1, 9))
        assert history.history["loss"] == seen.losses[8 * i:8 * (i + 1)]
