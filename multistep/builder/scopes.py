"""What the single step's ``loss_fn`` call sees of the graph: names, scopes, collections.

The step is built under ``multistep/step/``: its summaries are retagged with the tags a
single step's have, and the graph collections it adds to are read.
"""

import numpy as np
import tensorflow as tf

__all__ = ["op_collections_of", "retag"]


def retag(summaries, scope):
    """Give the summaries a step built the tags a single step's have: a
    ``tf.compat.v1.summary`` op takes its tag from the name scope it is built in, so the
    step's ``loss`` is tagged ``multistep/step/forward/loss``; ``scope`` (that prefix) is
    dropped from the constant tag each takes as its first input, as often as it leads it
    (a tag built from an op's name in the scope holds it twice). A single step builds the
    summary at the graph's top, where a name in use (``histogram("w", w)`` beside the
    variable ``w``) gives the tag a suffix (``w_1``): so does the stripped tag."""
    graph = tf.compat.v1.get_default_graph()

    def strip(tag):
        while tag.startswith(scope):
            tag = tag[len(scope):]
        with graph.name_scope(None):
            return graph.unique_name(tag, mark_as_used=False)

    for summary in summaries:
        op = getattr(summary, "op", summary)
        if not op.inputs or op.inputs[0].dtype != tf.string or op.inputs[0].op.type != "Const":
            continue
        tags = tf.get_static_value(op.inputs[0])
        if isinstance(tags, bytes):
            retagged = strip(tags.decode()).encode()
        else:
            retagged = np.vectorize(lambda t: strip(t.decode()).encode(), otypes=[object])(tags)
        with graph.name_scope(op.name + "/"):
            op._update_input(0, tf.constant(retagged, dtype=tf.string, name="tag"))


# Collections of variables, and of other things than ops and tensors.
_VARIABLE_COLLECTIONS = frozenset({
    tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
    tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES, tf.compat.v1.GraphKeys.MODEL_VARIABLES,
    tf.compat.v1.GraphKeys.MOVING_AVERAGE_VARIABLES, tf.compat.v1.GraphKeys.METRIC_VARIABLES,
    tf.compat.v1.GraphKeys.CONCATENATED_VARIABLES, tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS,
    tf.compat.v1.GraphKeys.RESOURCES, tf.compat.v1.GraphKeys.LOCAL_RESOURCES})


def op_collections_of(graph):
    """The keys of ``graph``'s collections that may hold a step's ops and tensors (not
    variables, nor v1 control flow's contexts)."""
    return [key for key in graph.get_all_collection_keys()
            if isinstance(key, str) and key not in _VARIABLE_COLLECTIONS
            and not any(type(x).__name__.endswith("Context") for x in graph.get_collection(key))]
