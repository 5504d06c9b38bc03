"""Keras 3: every inner step of ``fit(steps_per_execution=N)``.

With ``steps_per_execution=N`` Keras runs N steps per call of its compiled train function
and calls the callbacks once per call, with the logs of the last step. ``StepHistory``
keeps what each inner step's logs were: its ``train_step`` writes them into ``[N]``
buffers inside the compiled execution, and the callback reads the buffers once per
execution.
"""

import os

import keras
import tensorflow as tf

__all__ = ["StepHistory"]


class StepHistory(keras.callbacks.Callback):
    """Every inner step's loss and metrics under ``model.fit(..., steps_per_execution=N)``.

    Why a callback: ``fit`` stays the user's own (its data handling, distribution,
    callbacks and checkpoints); the callback only wraps ``model.train_step`` so that each
    step also writes its logs (the values Keras would report after that step with
    ``steps_per_execution=1``) into an ``[N]`` buffer, which it reads once per execution.
    Training is unchanged: the writes read the logs, and nothing reads the buffers inside.

    Args:
      callbacks: Keras callbacks whose ``on_train_batch_end(step, logs)`` is called once per
        inner step, with the step's true index (0-based, counted over the whole fit) and
        that step's logs; and their ``on_train_begin`` and ``on_train_end``.
      log_dir: if given, a TensorBoard scalar per inner step and log key, at its true
        step number (1-based: the optimizer's iteration after it), under ``log_dir``.

    Attributes:
      history: key -> list of every inner step's value, in order.
      steps: the true step numbers (1-based) of those values.

    Example:
      >>> import keras, numpy as np, multistep as ms
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
      >>> steps = ms.keras.StepHistory()
      >>> _ = model.fit(np.ones((32, 2)), np.ones((32, 1)), batch_size=4, epochs=1, verbose=0,
      ...               callbacks=[steps])
      >>> steps.steps
      [1, 2, 3, 4, 5, 6, 7, 8]
      >>> len(steps.history["loss"])
      8
    """

    def __init__(self, callbacks=(), log_dir=None):
        super().__init__()
        self.callbacks = list(callbacks)
        for i, callback in enumerate(self.callbacks):
            if not isinstance(callback, keras.callbacks.Callback):
                raise TypeError(f"StepHistory: callbacks[{i}] must be a keras.callbacks.Callback "
                                f"(its on_train_batch_end is called once per inner step), got "
                                f"{callback!r}.")
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"StepHistory: log_dir must be a directory path, got {log_dir!r}.")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.history, self.steps = {}, []
        self._buffers = self._count = None
        self._spe = None  # the steps per execution the buffers hold
        self._offset = 0  # steps counted in buffers made before the current ones
        self._read = 0  # steps read from the current buffers
        self._writer = None
        self._original = None  # the model's train_step while wrapped (during a fit)
        self._own_function = None  # the model's train function before the fit
        self._traced = None  # (model, compile config, steps per execution, wrapper, function)

    def set_model(self, model):
        super().set_model(model)
        for callback in self.callbacks:
            callback.set_model(model)
        if self._original is not None:
            return
        spe = getattr(model, "steps_per_execution", 1) or 1
        if isinstance(spe, bool) or not isinstance(spe, int):
            raise TypeError(
                f"StepHistory needs compile(steps_per_execution=N) with an int N (the size of "
                f"its per-step buffers), got {spe!r}.")
        config = getattr(model, "_compile_config", None)
        self._original, self._own_function = model.train_step, model.train_function
        traced = self._traced
        if traced is not None and traced[0] is model and traced[1] is config and traced[2] == spe:
            # The same model, compiled the same way: the train function traced in an
            # earlier fit, with this callback's train_step (no retrace, no recompile).
            model.train_step, model.train_function = traced[3], traced[4]
            return
        if self._spe is not None and spe != self._spe:  # new buffers, sized for the new N
            self._offset += self._read
            self._read, self._buffers, self._count = 0, None, None
        self._spe = spe
        model.train_step = self._wrapped(self._original)
        model.train_function = None  # made again, with this train_step

    def _wrapped(self, original):
        def train_step(data):
            logs = original(data)
            scalars = {k: v for k, v in logs.items() if tf.convert_to_tensor(v).shape.rank == 0}
            if self._buffers is None:  # at the first trace: eager variables, not the trace's
                with tf.init_scope():
                    self._buffers = {k: tf.Variable(tf.zeros([self._spe], tf.float32),
                                                    trainable=False, name=f"step_history_{k}")
                                     for k in scalars}
                    self._count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                              name="step_history_count")
            at = tf.math.floormod(self._count, self._spe)
            writes = [self._buffers[k].scatter_nd_update(
                [[at]], [tf.cast(v, tf.float32)]) for k, v in scalars.items() if k in self._buffers]
            with tf.control_dependencies(writes):
                counted = self._count.assign_add(1)
            with tf.control_dependencies([counted]):
                return {k: tf.identity(v) for k, v in logs.items()}
        return train_step

    def on_train_begin(self, logs=None):
        if self.log_dir is not None and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        for callback in self.callbacks:
            callback.on_train_begin(logs)

    def on_train_batch_end(self, batch, logs=None):
        if self._buffers is None:
            return
        count = int(self._count.numpy())
        values = {k: v.numpy() for k, v in self._buffers.items()}
        for j in range(count - self._read):
            step = self._offset + self._read + j  # 0-based over every fit
            slot = (self._read + j) % self._spe
            step_logs = {k: float(values[k][slot]) for k in values}
            for k, v in step_logs.items():
                self.history.setdefault(k, []).append(v)
            self.steps.append(step + 1)
            for callback in self.callbacks:  # (TensorBoard counts its steps at the begin)
                callback.on_train_batch_begin(step, None)
                callback.on_train_batch_end(step, step_logs)
            if self._writer is not None:
                with self._writer.as_default():
                    for k, v in step_logs.items():
                        tf.summary.scalar(k, v, step=step + 1)
        self._read = count

    def on_epoch_begin(self, epoch, logs=None):
        for callback in self.callbacks:
            callback.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        for callback in self.callbacks:
            callback.on_epoch_end(epoch, logs)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()
        for callback in self.callbacks:
            callback.on_train_end(logs)
        # The model's own train_step and train function again; the traced one is kept for
        # the next fit of the same model and configuration.
        if self._original is not None and "train_step" in vars(self.model):
            self._traced = (self.model, getattr(self.model, "_compile_config", None), self._spe,
                            self.model.train_step, self.model.train_function)
            del self.model.train_step
            self.model.train_function = self._own_function
        self._original = self._own_function = None
