"""Keras 3: every inner step of ``fit(steps_per_execution=N)``.

With ``steps_per_execution=N`` Keras runs N steps per call of its compiled train function
and calls the callbacks once per call, with the logs of the last step. ``StepHistory``
keeps what each inner step's logs were: its ``train_step`` counts itself and writes them
into row (count % rows) of a buffer inside the compiled execution (one scatter a step),
and the callback reads the count and the buffer after each execution when it has
callbacks to call, else at each epoch's end and before the buffer would wrap.
"""

import os

import keras
import numpy as np
import tensorflow as tf

__all__ = ["StepHistory"]

_LAST = "_multistep_step_history"  # the model's attribute: the last StepHistory of its fits
_ROWS = 1024  # the buffer's rows (at least N): read once in this many steps without callbacks


class StepHistory(keras.callbacks.Callback):
    """Every inner step's loss and metrics under ``model.fit(..., steps_per_execution=N)``.

    Why a callback: ``fit`` stays the user's own (its data handling, distribution,
    callbacks and checkpoints); the callback only wraps ``model.train_step`` so that each
    step also writes its logs (the values Keras would report after that step with
    ``steps_per_execution=1``) into a buffer, which it reads between executions.
    Training is unchanged: the writes read the logs, and nothing reads the buffers inside.

    Args:
      callbacks: Keras callbacks whose ``on_train_batch_end(step, logs)`` is called once per
        inner step, with the step's true index (0-based, counted over the whole fit) and
        that step's logs; and their ``on_train_begin`` and ``on_train_end``.
      log_dir: if given, a TensorBoard scalar per inner step and log key, at its true
        step number (1-based: the optimizer's iteration after it), under ``log_dir``.

    Attributes:
      history: key -> list of every inner step's value, in order: complete at the end of
        each epoch and of the fit (with ``callbacks`` or ``log_dir``, after every
        execution; without, the buffer of 1024 steps is read only before it would wrap).
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
        if not isinstance(callbacks, (list, tuple)):
            fix = (" (for none, leave it out: its default is ())" if callbacks is None else
                   " (one callback: callbacks=[it])")
            raise TypeError(f"StepHistory: callbacks must be a list of keras.callbacks.Callback "
                            f"(each called once per inner step), got {callbacks!r}{fix}.")
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
        self._buffer = self._count = self._keys = None
        self._spe = None  # the steps per execution the buffers hold
        self._offset = 0  # steps counted in buffers made before the current ones
        self._read = 0  # steps read from the current buffers
        self._unread = 0  # at most this many steps written since the last read
        self._rows = None  # the buffer's rows: a multiple of N
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
        earlier = getattr(model, _LAST, None)  # another StepHistory's, from an earlier fit
        if (self._buffer is None and earlier is not None and earlier[0]._traced is not None
                and earlier[0]._traced[1] is config and earlier[0]._traced[2] == spe):
            # A new StepHistory for each fit: its train function and buffers, this one's
            # steps counted from the buffers' count now (no retrace, no recompile).
            other = earlier[0]
            self._buffer, self._count, self._keys = other._buffer, other._count, other._keys
            self._rows, self._spe, self._traced = other._rows, spe, (model, *other._traced[1:])
            self._read = int(tf.raw_ops.ReadVariableOp(resource=self._count.handle,
                                                       dtype=tf.int64).numpy())
            self._offset = -self._read
            model.train_step, model.train_function = other._traced[3], other._traced[4]
            return
        # Another model, compile or N: new buffers, made at the trace, sized for N and the
        # logs' keys (the last fit's steps were all read at its end).
        self._offset += self._read
        self._read, self._buffer, self._count = 0, None, None
        self._spe = spe
        model.train_step = self._wrapped(self._original)
        model.train_function = None  # made again, with this train_step

    def _wrapped(self, original):
        def train_step(data):
            logs = original(data)
            if self._buffer is None:  # at the first trace: eager variables, not the trace's
                self._keys = [k for k, v in logs.items()
                              if tf.convert_to_tensor(v).shape.rank == 0]
                with tf.init_scope():
                    # Row number % rows: step `number`'s scalars, float32 as Keras reports
                    # them (the number itself is the count, read when the rows are).
                    self._rows = self._spe * max(1, _ROWS // self._spe)
                    self._buffer = tf.Variable(
                        tf.zeros([self._rows, len(self._keys)], tf.float32),
                        trainable=False, name="step_history")
                    self._count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                              name="step_history_count")
            # The fewest ops a step (a count, its row, one scatter): what the callback reads
            # between executions.
            number = self._count.assign_add(1)
            if self._keys:
                tf.raw_ops.ResourceScatterUpdate(
                    resource=self._buffer.handle, indices=tf.math.floormod(number, self._rows),
                    updates=tf.stack([tf.cast(logs[k], tf.float32) for k in self._keys]))
            return logs  # (the writes run: the train function's automatic control deps)
        return train_step

    def on_train_begin(self, logs=None):
        if self.log_dir is not None and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        for callback in self.callbacks:
            callback.on_train_begin(logs)

    def on_train_batch_end(self, batch, logs=None):
        if self._buffer is None:
            return
        self._unread += self._spe  # (at most: the data may have run out)
        # With callbacks or log_dir, each execution's steps go on at once; else the buffer
        # is read only before it could wrap, and at each epoch's end (a read costs about
        # a tenth of a small model's step).
        if self.callbacks or self._writer is not None or self._unread + self._spe > self._rows:
            self._collect()

    def _collect(self):
        """Every step written since the last read: into ``history`` and ``steps``, to the
        callbacks and to TensorBoard."""
        if self._buffer is None:
            return
        # (Read ops: a variable's .numpy() also copies it through an Identity.)
        count = int(tf.raw_ops.ReadVariableOp(resource=self._count.handle,
                                              dtype=tf.int64).numpy())
        rows = tf.raw_ops.ReadVariableOp(resource=self._buffer.handle, dtype=tf.float32).numpy()
        numbers = np.arange(self._read + 1, count + 1)  # the steps since, 1-based
        values = rows[numbers % self._rows]
        for j, k in enumerate(self._keys):
            self.history.setdefault(k, []).extend(values[:, j].tolist())
        self.steps.extend((self._offset + numbers).tolist())
        self._read, self._unread = count, 0
        if not self.callbacks and self._writer is None:
            return
        for number, row in zip(numbers.tolist(), values.tolist()):
            step = self._offset + number - 1  # 0-based over every fit
            step_logs = dict(zip(self._keys, row))
            for callback in self.callbacks:  # (TensorBoard counts its steps at the begin)
                callback.on_train_batch_begin(step, None)
                callback.on_train_batch_end(step, step_logs)
            if self._writer is not None:
                with self._writer.as_default():
                    for k, v in step_logs.items():
                        tf.summary.scalar(k, v, step=step + 1)

    def on_epoch_begin(self, epoch, logs=None):
        for callback in self.callbacks:
            callback.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._collect()
        for callback in self.callbacks:
            callback.on_epoch_end(epoch, logs)

    def on_train_end(self, logs=None):
        self._collect()
        if self._writer is not None:
            self._writer.flush()
        for callback in self.callbacks:
            callback.on_train_end(logs)
        # The model's own train_step and train function again; the traced one is kept for
        # the next fit of the same model and configuration.
        if self._original is not None and "train_step" in vars(self.model):
            self._traced = (self.model, getattr(self.model, "_compile_config", None), self._spe,
                            self.model.train_step, self.model.train_function)
            # (for a new StepHistory in the model's next fit; set past Keras's tracking)
            object.__setattr__(self.model, _LAST, (self,))
            del self.model.train_step
            self.model.train_function = self._own_function
        self._original = self._own_function = None
