"""TensorBoard output: the unrolled graph."""

import tensorflow as tf

__all__ = ["write_graph"]


def write_graph(graph, logdir):
    """Writes ``graph`` to an event file under ``logdir`` for TensorBoard's Graphs tab.

    With ``ms.unroll``'s scopes the graph folds into ``name/step_1 ... step_N``,
    each holding ``forward``, ``gradients`` and ``apply``.
    """
    with graph.as_default():
        writer = tf.compat.v1.summary.FileWriter(logdir, graph=graph)
    writer.close()
    return logdir
