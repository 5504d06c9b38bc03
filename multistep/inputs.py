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
        with tf.name_scope("inputs"):
            for i, value in enumerate(tf.nest.flatten(inputs)):
                self.flat.append(_leading_dimension_checked(tf.convert_to_tensor(value), i, steps))

    def args(self, index):
        """Positional arguments for the step at 0-based ``index`` (an int or a scalar tensor)."""
        if self.structure is None:
            return ()
        if self.iterator is not None:
            element = self.iterator.get_next()
        else:
            element = tf.nest.pack_sequence_as(self.structure, [t[index] for t in self.flat])
        return tuple(element) if type(self.structure) in (tuple, list) else (element,)


def _leading_dimension_checked(t, i, steps):
    where = f"inputs (flattened item {i}, {t.name!r})"
    if t.shape.rank == 0:
        raise ValueError(f"{where} is a scalar; it needs a leading dimension of steps={steps}.")
    lead = t.shape[0] if t.shape.rank is not None else None
    if lead is not None and lead != steps:
        raise ValueError(
            f"{where} has leading dimension {lead}, expected steps={steps}: "
            f"step k takes slice k, so pass one slice per inner step.")
    if lead is not None:
        return t
    check = tf.debugging.assert_equal(
        tf.shape(t)[0], steps, message=f"{where}: leading dimension must equal steps={steps}")
    with tf.control_dependencies([check]):
        return tf.identity(t)

