"""What each inner step's ``loss_fn`` call sees of the graph: names, scopes, collections.

``loss_fn`` is called once per step, and TensorFlow's graph keeps state between the
calls that a single-step graph never sees twice: the counters that number unnamed layers
and variable scopes, the name scope a layer object entered on its first call, the graph
collections (``UPDATE_OPS``, ``'losses'``, ``SUMMARIES``), the variable store's reuse
flag. Here each step's call is given what a single step's would see, so that steps 2..N
ask for step 1's variables, name their ops (and summary tags) as a single step does,
and sum their own collection terms.
"""

import contextlib
import dataclasses
import os
import sys
import traceback

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import variable_scope as variable_scope_lib  # the scope counters

__all__ = ["Collections", "EMA_FIX", "NameCounters", "retag", "reuse_variables",
           "scopes_moved", "variables_named_per_step"]


@contextlib.contextmanager
def scopes_moved(graph, first, now):
    """While step k's forward pass is built: a name scope under step 1's forward scope
    ``first`` is entered under this step's, ``now``.

    A layer object built in step 1 (a ``tf.compat.v1.layers.Dense`` made outside
    ``loss_fn``) names the ops of every later call in the name scope of its first call,
    an absolute scope: ``multistep/step_1/forward/dense/``. Step k's calls would then be
    named ``dense/MatMul_3``, ``_4``, ``_5`` (after step 1's), where a single step's are
    ``MatMul``, ``_1``, ``_2``; Grappler sorts the terms of a gradient sum by name, and
    ``MatMul_1_grad < MatMul_2_grad < MatMul_grad`` but ``MatMul_3_grad < _4 < _5``: the
    kernel's gradient, shared by three calls, was summed in another order (6e-8 off). Moved
    under step k's scope, the ops get a single step's names, and sit in step k's block."""
    if first is None or first == now:
        yield
        return
    enter = graph.name_scope

    def name_scope(name):
        if isinstance(name, str) and name.startswith(first) and name.endswith("/"):
            name = now + name[len(first):]
        return enter(name)

    graph.name_scope = name_scope  # (the graph's own method; no public hook renames a scope)
    try:
        yield
    finally:
        del graph.name_scope


def retag(summaries, scope):
    """Give the summaries a step built the tags a single step's have: a
    ``tf.compat.v1.summary`` op takes its tag from the name scope it is built in, so step
    k's ``loss`` is tagged ``multistep/step_k/forward/loss``; ``scope`` (that prefix) is
    dropped from the constant tag each takes as its first input."""
    for summary in summaries:
        op = getattr(summary, "op", summary)
        if not op.inputs or op.inputs[0].dtype != tf.string or op.inputs[0].op.type != "Const":
            continue
        tags = tf.get_static_value(op.inputs[0])
        strip = lambda tag: tag[len(scope):] if tag.startswith(scope) else tag  # noqa: E731
        if isinstance(tags, bytes):
            retagged = strip(tags.decode()).encode()
        else:
            retagged = np.vectorize(lambda t: strip(t.decode()).encode(), otypes=[object])(tags)
        with tf.compat.v1.get_default_graph().name_scope(op.name + "/"):
            op._update_input(0, tf.constant(retagged, dtype=tf.string, name="tag"))


def reuse_variables(reuse):
    """From step 2 on, ``get_variable`` returns the variables step 1 made."""
    if not reuse:
        return contextlib.nullcontext()
    return tf.compat.v1.variable_scope(
        tf.compat.v1.get_variable_scope(), reuse=True, auxiliary_name_scope=False)


# Collections of variables (made by step 1 alone), and of other things than ops and tensors.
_VARIABLE_COLLECTIONS = frozenset({
    tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
    tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES, tf.compat.v1.GraphKeys.MODEL_VARIABLES,
    tf.compat.v1.GraphKeys.MOVING_AVERAGE_VARIABLES, tf.compat.v1.GraphKeys.METRIC_VARIABLES,
    tf.compat.v1.GraphKeys.CONCATENATED_VARIABLES, tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS,
    tf.compat.v1.GraphKeys.RESOURCES, tf.compat.v1.GraphKeys.LOCAL_RESOURCES})


@dataclasses.dataclass
class Collections:
    """The graph's collections of ops and tensors (``UPDATE_OPS``, the ``'losses'`` of the
    CIFAR-10 tutorial's ``tf.add_to_collection('losses', ...)`` and
    ``tf.add_n(tf.get_collection('losses'))``, ``tf.compat.v1.losses``' ``LOSSES``) as
    they were before step 1, so that each step's ``loss_fn`` sees the collections a
    single step's would: those from before, and its own additions. Step k's would
    otherwise follow step 1's, and a sum over the collection would add step 1's terms,
    computed from the weights before the run, to step k's. After each step the
    collections are put back as step 1 left them (a single-step graph's)."""

    before: dict  # key -> items before step 1
    first_added: dict = dataclasses.field(default_factory=dict)  # key -> items step 1 added

    @classmethod
    def read(cls, graph):
        return cls({key: list(graph.get_collection(key)) for key in op_collections_of(graph)})

    @contextlib.contextmanager
    def per_step(self, graph, first, label, step):
        """Around one step's ``loss_fn``; yields ``{key: items this step added}``."""
        added = {}
        kept = {key: list(graph.get_collection(key)) for key in op_collections_of(graph)}
        if not first:
            for key, items in self.first_added.items():
                # A lazily evaluated item (get_variable's regularizer term) makes its ops
                # anew, in the step, wherever it is used: it stays.
                graph.get_collection_ref(key)[:] = self.before.get(key, []) + [
                    x for x in items if not _made(x)]
        start = {key: len(graph.get_collection(key)) for key in op_collections_of(graph)}
        yield added
        for key in op_collections_of(graph):
            items = graph.get_collection_ref(key)
            added[key] = items[start.get(key, 0):]
            if not first:  # back as step 1 left them
                items[:] = kept.get(key, [])
        added = {key: items for key, items in added.items() if items}
        if first:
            self.first_added = dict(added)
            return
        for key, items in self.first_added.items():
            items = [x for x in items if _made(x)]
            if len([x for x in added.get(key, ()) if _made(x)]) != len(items):
                names = ", ".join(f"'{getattr(x, 'name', x)}'" for x in items[:3])
                raise ValueError(
                    f"{label}: step 1's loss_fn added {len(items)} item(s) to the graph "
                    f"collection '{key}' ({names}), inner step {step}'s added "
                    f"{len(added.get(key, ()))}. Each step sees the collections as a single "
                    f"step would, its own terms in them, so every step must add its own: a "
                    f"term made once, when step 1 created a variable (a layer's "
                    f"kernel_regularizer puts its penalty in 'regularization_losses' then), "
                    f"would be missing from every later step, or read the weights from "
                    f"before the run. Compute such a term inside loss_fn from the weights "
                    f"(e.g. 0.01 * tf.reduce_sum(tf.square(kernel)) for kernel_regularizer="
                    f"l2(0.01), added to the loss in place of get_regularization_loss()).")


def op_collections_of(graph):
    """The keys of ``graph``'s collections that may hold a step's ops and tensors (not
    variables, nor v1 control flow's contexts)."""
    return [key for key in graph.get_all_collection_keys()
            if isinstance(key, str) and key not in _VARIABLE_COLLECTIONS
            and not any(type(x).__name__.endswith("Context") for x in graph.get_collection(key))]


def _made(item):
    """Whether a collection's ``item`` was made once: not a ``_LazyEvalTensor`` (what
    ``get_variable(regularizer=...)`` adds), which makes its ops where it is used."""
    return type(item).__name__ != "_LazyEvalTensor"


@dataclasses.dataclass(frozen=True)
class NameCounters:
    """The per-graph counters that number unnamed layers and variable scopes.

    An unnamed ``tf.compat.v1.layers.dense`` (tf-keras) or a
    ``variable_scope(None, default_name="block")`` takes the next free name
    (``dense``, ``dense_1``, ...) each time it is called; ``loss_fn`` is called
    once per step, so step 2 would ask for ``dense_1/kernel``. Steps 2..N run
    ``loss_fn`` with the counters as step 1 found them, so they ask for step 1's
    names and reuse its variables; afterwards the counters are put back as step
    1 left them, as a single-step graph leaves them.
    """

    keras_uids: dict
    scope_counts: dict

    @staticmethod
    def _keras_uid_map():
        backend = sys.modules.get("tf_keras.src.backend")  # only if tf-keras is in use
        return backend.get_default_graph_uid_map() if backend is not None else None

    @classmethod
    def read(cls):
        uids = cls._keras_uid_map()
        return cls(dict(uids) if uids is not None else {},
                   dict(variable_scope_lib.get_variable_scope_store().variable_scopes_count))

    def write(self):
        uids = self._keras_uid_map()
        if uids is not None:
            uids.clear()
            uids.update(self.keras_uids)
        counts = variable_scope_lib.get_variable_scope_store().variable_scopes_count
        counts.clear()
        counts.update(self.scope_counts)

    @contextlib.contextmanager
    def restored(self):
        after = NameCounters.read()
        self.write()
        try:
            yield
        finally:
            after.write()


EMA_FIX = ("ExponentialMovingAverage.apply on a tensor (a loss) makes a shadow variable "
            "named after that tensor, and every step's tensor is a new one. Average a tensor "
            "in a variable of your own made before ms.unroll, e.g. avg.assign(0.9 * avg + "
            "0.1 * loss) added to UPDATE_OPS inside loss_fn; ema.apply(var_list) of variables "
            "(in after_apply) works as is.")


def made_by_ema(frames):
    """Whether ``frames`` (a traceback's, or the stack's: ``traceback.extract_stack()``)
    pass through ``ExponentialMovingAverage.apply``: its shadow variables are named after
    the averaged tensor and the EMA's ``name`` (the CIFAR-10 tutorial's ``avg``), so
    their names alone do not tell."""
    return any(frame.name == "apply" and frame.filename.endswith(
        os.path.join("training", "moving_averages.py")) for frame in frames)


@contextlib.contextmanager
def variables_named_per_step(first, step):
    """From step 2 on, ``get_variable`` reuses step 1's variables: one whose name depends
    on the step (an EMA's shadow of a tensor, named after it) does not exist, and
    TensorFlow's error advises ``reuse=tf.AUTO_REUSE``, which would make a variable per
    step. Said plainly, with the fix."""
    try:
        yield
    except ValueError as error:
        text = str(error)
        if first or "does not exist, or was not created with tf.get_variable()" not in text:
            raise
        name = text.split("Variable ", 1)[-1].split(" does not exist", 1)[0]
        why = (EMA_FIX if made_by_ema(traceback.extract_tb(error.__traceback__)) else
               "Every step must use step 1's variables: a variable's name must not depend on "
               "the step (nor on a tensor's name).")
        raise ValueError(f"loss_fn asked for variable {name!r} at inner step {step}, which "
                         f"step 1 did not create. {why}") from None
