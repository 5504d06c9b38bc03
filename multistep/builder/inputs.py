"""Per-step inputs: step k's arguments to ``loss_fn``.

Slice k of tensors with leading dimension N, or the next element of a
``tf.data`` iterator.
"""

import tensorflow as tf

__all__ = ["Inputs"]


class Inputs:
    """Step k's arguments to loss_fn: slice k of tensors, or the next element of an iterator."""

    def __init__(self, inputs, steps, *, xla):
        self.iterator, self.structure, self.flat = None, inputs, []
        if inputs is None:
            return
        if isinstance(inputs, tf.data.Dataset):
            with tf.name_scope("inputs"):
                inputs = tf.compat.v1.data.make_one_shot_iterator(inputs)
        if isinstance(inputs, tf.compat.v1.data.Iterator):
            if xla:
                raise ValueError(
                    "xla=True cannot take its steps' batches from a tf.data iterator: XLA "
                    "does not compile IteratorGetNext. Batch N steps at once instead, e.g. "
                    "inputs=tf.compat.v1.data.make_one_shot_iterator(ds.batch(N)).get_next().")
            self.iterator = inputs
            self.structure = tf.compat.v1.data.get_output_types(inputs)
            return
        for i, value in enumerate(tf.nest.flatten(inputs)):
            self.flat.append(_static_checked(tf.convert_to_tensor(value), i, steps))

    def check_lengths(self, steps, count=None):
        """From here on, step k's slice comes from inputs whose leading dimension is checked
        at run time against the steps the run does: ``steps``, or ``count`` (loop mode: the
        run length read from ``steps_per_run``). A loop-mode run shortened by
        ``set_steps_per_run`` (or ``AutoStepsHook``) and fed ``steps`` batches would
        otherwise train on the first ``count`` and drop the rest, silently."""
        with tf.name_scope("inputs"):
            self.flat = [_dynamic_checked(t, i, steps, count) for i, t in enumerate(self.flat)]

    def template(self):
        """The step's arguments as the compiled step reads them: (positional arguments,
        {the placeholder an argument is: the ``[N, ...]`` tensor whose slice k step k
        reads}). An iterator's element is taken in the step (its copies each take the next)."""
        if self.structure is None:
            return (), {}
        if self.iterator is not None:
            return self.args(0), {}
        given = {}
        with tf.name_scope("inputs"):
            for i, t in enumerate(self.flat):
                given[tf.compat.v1.placeholder(t.dtype, t.shape[1:], name=f"input_{i}")] = t
        element = tf.nest.pack_sequence_as(self.structure, list(given))
        args = tuple(element) if type(self.structure) in (tuple, list) else (element,)
        return args, given

    def args(self, index):
        """Positional arguments for the step at 0-based ``index`` (an int or a scalar tensor)."""
        if self.structure is None:
            return ()
        if self.iterator is not None:
            element = self.iterator.get_next()
        else:
            element = tf.nest.pack_sequence_as(self.structure, [t[index] for t in self.flat])
        return tuple(element) if type(self.structure) in (tuple, list) else (element,)


def _where(t, i):
    return f"inputs (flattened item {i}, {t.name!r})"


def _static_checked(t, i, steps):
    if t.shape.rank == 0:
        raise ValueError(f"{_where(t, i)} is a scalar; it needs a leading dimension of steps={steps}.")
    lead = t.shape[0] if t.shape.rank is not None else None
    if lead is not None and lead != steps:
        raise ValueError(
            f"{_where(t, i)} has leading dimension {lead}, expected steps={steps}: "
            f"step k takes slice k, so pass one slice per inner step.")
    return t


def _dynamic_checked(t, i, steps, count):
    lead = t.shape[0] if t.shape.rank is not None else None
    if count is None:
        if lead is not None:
            return t
        check = tf.debugging.assert_equal(
            tf.shape(t)[0], steps, message=f"{_where(t, i)}: leading dimension must equal steps={steps}")
    else:
        check = tf.debugging.assert_equal(
            tf.shape(t)[0], count, message=(
                f"{_where(t, i)}: its leading dimension (the batches fed) must equal the "
                f"steps this run does (Unrolled.steps_per_run, set by set_steps_per_run or "
                f"AutoStepsHook; at most steps={steps}), or the batches past them would be "
                f"dropped. Feed one batch per step the run does (a placeholder with leading "
                f"dimension None takes any), or set steps_per_run to the batches fed"))
    with tf.control_dependencies([check]):
        return tf.identity(t)
