"""Python every K steps, in the graph: ``ms.every(k, fn, after=train_op)``.

A training loop often runs an op between ``sess.run`` calls every K steps: a DQN copies
its online network into its target network, a schedule drops the learning rate.
``ms.compile`` runs the *step* N times in one call, so a Python ``if`` between calls runs
once a call, not once a step. ``every`` moves that ``if`` into the step: a ``tf.cond``,
ordered after the step's train op, that runs ``fn``'s ops when the global step (read
after the train op) is a multiple of ``k``. Fetched with the step, it runs in each of its
single steps and, compiled, in each compiled step, like any other op of the step.
"""

import numbers

import tensorflow as tf

from multistep import graph as graph_lib

__all__ = ["every"]


def every(k, fn, *, after, global_step=None, name="every"):
    """Runs ``fn``'s ops after ``after`` in each step whose global step is a multiple of ``k``.

    The in-graph form of a loop's ``sess.run(train); if global_step % k == 0:
    sess.run(ops)``. Fetch what it returns with the train op (in the single step and in
    ``ms.compile``'s fetches), and drop the Python ``if``.

    Args:
      k: the period, an int >= 1.
      fn: a callable that builds the ops to run (``lambda: [t.assign(s) for t, s in
        pairs]``); called once, inside the ``tf.cond`` branch, so that its ops run only
        when the branch does.
      after: the op (or tensor) the step ends with, usually the train op: ``fn``'s ops
        run after it and read what it wrote.
      global_step: the step counter (default: the graph's global step), read after
        ``after``.
      name: the name scope.

    Returns:
      A bool scalar tensor: whether ``fn``'s ops ran in this step.

    Example:
      >>> import numpy as np, tensorflow as tf, multistep as ms
      >>> V1 = tf.compat.v1
      >>> with tf.Graph().as_default():
      ...     w = V1.get_variable("w", initializer=1.0)
      ...     target = V1.get_variable("target", initializer=0.0)
      ...     step = V1.train.get_or_create_global_step()
      ...     train = V1.train.GradientDescentOptimizer(0.1).minimize(w * w, global_step=step)
      ...     copied = ms.every(2, lambda: [target.assign(w)], after=train)
      ...     fused = ms.compile([train, copied], steps=4)
      ...     with V1.Session() as sess:
      ...         sess.run(V1.global_variables_initializer())
      ...         print(fused.run(sess)[1], sess.run(target) == sess.run(w))
      [False  True False  True] True
    """
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"ms.every: k must be an int >= 1, got {k!r}.")
    if not callable(fn):
        raise TypeError(f"ms.every: fn must be a callable that builds the ops to run, got "
                        f"{type(fn).__name__}.")
    graph = tf.compat.v1.get_default_graph()
    step = global_step if global_step is not None else graph_lib.global_step_variable(graph)
    if step is None:
        raise ValueError("ms.every: no global step to count by: build it "
                         "(tf.compat.v1.train.get_or_create_global_step()) or pass global_step=.")
    after = getattr(after, "op", after)
    if not isinstance(after, tf.Operation):
        raise TypeError(f"ms.every: after must be the step's train op, got {after!r}.")
    if after.graph is not graph:
        raise ValueError(f"ms.every: after, {after.name!r}, is an op of another graph than the "
                         f"default graph the ops are built in; build them in its graph "
                         f"(with after.graph.as_default():).")

    def run():
        ops = [getattr(op, "op", op) for op in tf.nest.flatten(fn())]
        with tf.control_dependencies(ops):
            return tf.constant(True)

    with tf.name_scope(name), tf.control_dependencies([after]):
        now = tf.identity(step.read_value() if hasattr(step, "read_value") else step)
        due = tf.equal(now % tf.cast(k, now.dtype), 0)
        return tf.cond(due, run, lambda: tf.constant(False), name="cond")
