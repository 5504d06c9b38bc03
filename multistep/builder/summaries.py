"""TensorBoard: the unrolled graph, and a scalar point for every inner step.

One fused run returns ``[N]`` vectors (``Unrolled.losses`` and
``Unrolled.records``), so the loss curve gets one point per real optimizer
step, at its own global step, without extra ``sess.run`` calls:

    writer = tf.compat.v1.summary.FileWriter(logdir, graph)
    for run in range(runs):
        _, losses = sess.run([fused.train_op, fused.losses])
        ms.summaries.write_steps(writer, run * N + 1, {"loss": losses})
"""

import collections
import glob
import os
import re

import numpy as np
import tensorflow as tf

__all__ = ["StepSummary", "format_graph_summary", "graph_summary", "write_graph", "write_run",
           "write_steps"]


def write_graph(graph, logdir):
    """Writes ``graph`` to an event file under ``logdir`` for TensorBoard's Graphs tab.

    With ``ms.unroll``'s scopes the graph folds into ``name/step_1 ... step_N``,
    each holding ``forward``, ``gradients``, ``transform`` and ``apply``.

    Examples:
      >>> import os, tempfile, tensorflow as tf, multistep as ms
      >>> with tf.Graph().as_default() as graph:
      ...     w = tf.compat.v1.get_variable("w", initializer=[1.0])
      ...     fused = ms.unroll(lambda: tf.reduce_sum(w * w),
      ...                       tf.compat.v1.train.GradientDescentOptimizer(0.1), 3)
      >>> logdir = ms.summaries.write_graph(graph, tempfile.mkdtemp())
      >>> [f.split(".")[0] for f in os.listdir(logdir)]
      ['events']
    """
    with graph.as_default():
        writer = tf.compat.v1.summary.FileWriter(logdir, graph=graph)
    writer.close()
    return logdir


def write_run(logdir, graph, values, *, first_step=1):
    """A TensorBoard run in ``logdir``: ``graph`` and ``values`` (tag -> per-step array).

    Event files left in ``logdir`` by an earlier call are removed first, so the
    run holds one curve, not two overlaid.
    """
    if os.path.isdir(logdir):
        for stale in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
            os.remove(stale)
    with graph.as_default():
        writer = tf.compat.v1.summary.FileWriter(logdir, graph=graph)
    write_steps(writer, first_step, values)
    writer.close()
    return logdir


def write_steps(writer, first_step, values, *, prefix=""):
    """Writes one scalar per inner step: ``values[tag][k]`` at global step ``first_step + k``.

    Args:
      writer: a ``tf.compat.v1.summary.FileWriter``.
      first_step: the global step of the first inner step (1 for the first run).
      values: tag -> 1-D array, e.g. ``{"loss": losses, "grad_norm": norms}``.
      prefix: prepended to every tag.

    Example:
      >>> import tempfile, multistep as ms, tensorflow as tf
      >>> with tf.Graph().as_default():
      ...     writer = tf.compat.v1.summary.FileWriter(tempfile.mkdtemp())
      >>> ms.summaries.write_steps(writer, 4, {"loss": [0.5, 0.4, 0.3]})
      [4, 5, 6]
      >>> writer.close()
    """
    steps = None
    for tag, series in values.items():
        series = np.asarray(series, np.float64).reshape(-1)
        steps = [first_step + k for k in range(len(series))]
        for step, value in zip(steps, series):
            summary = tf.compat.v1.Summary(
                value=[tf.compat.v1.Summary.Value(tag=prefix + tag, simple_value=float(value))])
            writer.add_summary(summary, step)
    writer.flush()
    return steps


StepSummary = collections.namedtuple("StepSummary", "scope ops reads")


def graph_summary(graph, name="multistep"):
    """Per-step op counts, variable reads and the control edges between steps.

    Returns ``(steps, edges)``: ``steps`` is a list of ``StepSummary(scope, ops,
    reads)`` with ``reads`` a dict variable -> reading ops; ``edges`` maps
    ``(from scope, to scope)`` to the number of control edges between them.

    Examples:
      >>> import tensorflow as tf, multistep as ms
      >>> with tf.Graph().as_default() as graph:
      ...     w = tf.compat.v1.get_variable("w", initializer=[1.0])
      ...     fused = ms.unroll(lambda: tf.reduce_sum(w * w),
      ...                       tf.compat.v1.train.GradientDescentOptimizer(0.1), 3)
      >>> steps, edges = ms.summaries.graph_summary(graph)
      >>> [s.scope for s in steps], sorted(edges)
      (['step_1', 'step_2', 'step_3'], [('step_1', 'step_2'), ('step_2', 'step_3')])
      >>> print(ms.summaries.format_graph_summary(steps, edges))  # doctest: +ELLIPSIS
      step_1: ... ops (...)
        reads w: ...
      ...
      control edges between steps:
        step_1 -> step_2: ...
        step_2 -> step_3: ...
    """
    # (The single step the copies copy, ``name/step/``, runs in no run: not counted.)
    pattern = re.compile(rf"^{re.escape(name)}/(step_\d+|loop)/")
    scope_of = {}
    for op in graph.get_operations():
        match = pattern.match(op.name)
        if match:
            scope_of[op] = match.group(1)
    steps = {}
    for op, scope in scope_of.items():
        summary = steps.setdefault(scope, StepSummary(scope, [], collections.defaultdict(list)))
        summary.ops.append(op)
        for tensor in op.inputs:
            if tensor.op.type in ("VarHandleOp", "VariableV2") and op.type != "VarIsInitializedOp":
                summary.reads[tensor.op.name].append(op.name)
    edges = collections.Counter()
    for op, scope in scope_of.items():
        for control in op.control_inputs:
            source = scope_of.get(control)
            if source is not None and source != scope:
                edges[(source, scope)] += 1
    return [steps[s] for s in sorted(steps, key=_order)], dict(edges)


def format_graph_summary(steps, edges):
    """``graph_summary``'s result as text, as ``multistep graph`` prints it."""
    lines = []
    for summary in steps:
        parts = collections.Counter(_part(op.name) for op in summary.ops)
        lines.append(f"{summary.scope}: {len(summary.ops)} ops ("
                     + ", ".join(f"{part} {count}" for part, count in sorted(parts.items())) + ")")
        for var, readers in sorted(summary.reads.items()):
            shown = ", ".join(r.split(f"{summary.scope}/", 1)[-1] for r in readers[:3])
            more = f", +{len(readers) - 3} more" if len(readers) > 3 else ""
            lines.append(f"  reads {var}: {shown}{more}")
    lines.append("control edges between steps:")
    for (source, target), count in sorted(edges.items(), key=lambda e: [_order(s) for s in e[0]]):
        lines.append(f"  {source} -> {target}: {count} control input{'s' if count > 1 else ''}")
    return "\n".join(lines)


def _part(op_name):
    """forward, gradients, transform, record, apply (or body for a loop) of an op name."""
    parts = op_name.split("/")
    return parts[2] if len(parts) > 3 else "-"


def _order(scope):
    """Sort key: step_1, step_2, ..., then loop."""
    return (scope == "loop", int(scope.split("_")[1]) if "_" in scope else 0)
