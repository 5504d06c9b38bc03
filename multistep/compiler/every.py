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

__all__ = ["EVERY", "every"]

EVERY = "multistep_every"  # the graph collection of every's conds (verify names them)


def every(k, fn, *, after=None, before=None, global_step=None, name="every"):
    """Runs ``fn``'s ops after ``after`` in each step whose global step is a multiple of
    ``k``; or, given ``before`` instead, before the step ``before`` ends.

    The in-graph form of a loop's ``sess.run(train); if global_step % k == 0:
    sess.run(ops)``. Fetch what it returns with the train op (in the single step and in
    ``ms.compile``'s fetches), and drop the Python ``if``. With ``before=train_op``, the
    form of ``if global_step % k == 0: sess.run(ops)`` *above* ``sess.run(train)`` (a
    DQN that copies its target network when its counter is 0, then trains): the global
    step is read before the step, and the step's reads of state wait for ``fn``'s ops, so
    the step trains on what they wrote. The train op then runs them itself: no fetch
    needed.

    Args:
      k: the period, an int >= 1.
      fn: a callable that builds the ops to run (``lambda: [t.assign(s) for t, s in
        pairs]``); called once, inside the ``tf.cond`` branch, so that its ops run only
        when the branch does.
      after: the op (or tensor) the step ends with, usually the train op: ``fn``'s ops
        run after it and read what it wrote.
      before: instead of ``after``: the train op, whose step runs ``fn``'s ops first.
      global_step: the step counter (default: the graph's global step), read after
        ``after`` (before the step, with ``before``).
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
    if (after is None) == (before is None):
        raise TypeError("ms.every: give after= (run fn's ops after the train op) or before= "
                        "(before the step the train op ends), one of them.")
    where = "after" if after is not None else "before"
    target = after if after is not None else before  # (no `or`: a tensor has no bool)
    op = getattr(target, "op", target)
    if not isinstance(op, tf.Operation):
        raise TypeError(f"ms.every: {where} must be the step's train op, got {op!r}.")
    if op.graph is not graph:
        raise ValueError(f"ms.every: {where}, {op.name!r}, is an op of another graph than the "
                         f"default graph the ops are built in; build them in its graph "
                         f"(with {where}.graph.as_default():).")

    def run():
        ops = [getattr(op, "op", op) for op in tf.nest.flatten(fn())]
        with tf.control_dependencies(ops):
            return tf.constant(True)

    with tf.name_scope(name), tf.control_dependencies([] if before is not None else [op]):
        now = tf.identity(step.read_value() if hasattr(step, "read_value") else step)
        due = tf.equal(now % tf.cast(k, now.dtype), 0)
        ran = tf.cond(due, run, lambda: tf.constant(False), name="cond")
    graph.add_to_collection(EVERY, ran.op)
    if before is not None:
        _first(ran.op, op)
    return ran


def _first(ran, train):
    """Orders ``ran`` before every op of ``train``'s step that reads or writes state
    (a variable's read, an apply, a cond or call given a variable), outside control flow
    (an op inside a v1 cond or loop gets its state through one of those); not one that
    ``ran`` itself reads (``fn`` built on a tensor of the step): that would be a cycle."""
    feeding = graph_lib.ancestors([ran])
    for op in graph_lib.ancestors([train]):
        if op in feeding or op._get_control_flow_context() is not None:  # noqa: SLF001
            continue
        if op is train or any(t.dtype == tf.resource or t.dtype._is_ref_dtype  # noqa: SLF001
                               for t in op.inputs):
            op._add_control_input(ran)  # noqa: SLF001
