"""ms.keras.StepHistory against Keras itself: the per-batch logs of fit with
steps_per_execution=1, and the weights of fit with steps_per_execution=N without it."""

import keras
import numpy as np
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
