"""The original step's ops beside its compiled program: reported at the program's next run.

After ``ms.compile``, the original train op and forward pass are still in the graph, and a
loop may still run them: a TensorFlow hook that fetches the original loss, an evaluation
``sess.run`` through the original forward pass. Where such a run changes what the compiled
steps see (it takes a batch from the shared input, draws from a random op whose stream
the compiled copy does not follow, applies an update of its own), the program no longer
does what it did as written.

``Tripwires`` keeps the cost of that watch off the user's own step: each kind of effect
gets one in-graph write, an insert of its key into a hash table of the session, that the
original ops of that kind wait on (a few µs a run, no Python). The compiled program
reads the table before its first step (``Tripwires.check``: two sizes compared, a
branch not taken); when a key is new to the session, it warns
(``OriginalOpRanWarning``), once a kind of effect a session, naming the ops, what their
run did and, where a summary reads them, the hook that runs the summaries. An op inside
a v1 cond or loop gets its write inside the same cond or loop (it runs where the op
runs); a functional cond (``If``) whose one branch draws, only when that branch is
taken. The compiled copies never run a tripwire, and ``ms.compile`` leaves them out of
the steps it copies.
"""

import collections
import threading
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_ops

from multistep import graph as graph_lib

__all__ = ["EFFECTS", "OriginalOpRanWarning", "TRIPWIRES", "Tripwires", "effect_of",
           "is_tripwire_name", "ran_message"]

TRIPWIRES = "multistep_tripwires"  # the graph collection of the tripwires' ops
_SCOPE = "_original_ran"
_CONDS = ("If", "StatelessIf")


class OriginalOpRanWarning(RuntimeWarning):
    """An op of a compiled step's original ran beside the compiled program."""


RANDOM = ("drew from its random stream, which the compiled steps' own copy of the op "
          "does not follow: the compiled steps now draw other numbers than the program "
          "as written")
INPUT = ("took a batch of its own from the shared input, which no compiled step "
         "trains on")
WRITE = ("applied an update of its own (an extra step: weights, optimizer slots or "
         "the global step), beside the compiled steps")
EFFECTS = (RANDOM, INPUT, WRITE)  # (a warning a session each)


def effect_of(op):
    """What running the original ``op`` does to the compiled steps, or None if nothing.
    A call, functional cond or loop whose function draws (dropout in a ``tf.function``,
    a ``training`` switch under v2 control flow) draws."""
    if graph_lib.is_stateful_random(op) or (
            op.type not in _CONDS and "Dataset" not in op.type and _calls_random(op)):
        return RANDOM
    if op.type.startswith(("IteratorGetNext", "QueueDequeue", "ReaderRead")):
        return INPUT
    if graph_lib.is_write(op):
        return WRITE
    if op.type in _CONDS and _drawing_branches(op):
        return RANDOM
    return None


def _calls_random(op):
    return any(True for _ in graph_lib.random_in_functions(
        op.graph, graph_lib.called_functions(op.node_def)))


def _drawing_branches(op):
    """Of a functional cond: (whether its then branch draws, whether its else branch
    draws), or () if neither does."""
    draws = tuple(any(True for _ in graph_lib.random_in_functions(
        op.graph, [op.get_attr(branch).name])) for branch in ("then_branch", "else_branch"))
    return draws if any(draws) else ()


class Tripwires:
    """The watch over one compiled program's original ops. Made before the program
    (``check`` is what its first step waits on), then ``guard``-ed over the ops it
    copies."""

    def __init__(self, graph, label):
        self.label, self.graph, self.groups = label, graph, []
        with self._scope():
            table = dict(key_dtype=tf.int64, value_dtype=tf.int64, shared_name="",
                         use_node_name_sharing=True)
            self.ran = tf.raw_ops.MutableHashTableV2(**table, name="ran")
            self.warned = tf.raw_ops.MutableHashTableV2(**table, name="warned")
            self.told = tf.raw_ops.MutableHashTableV2(**table, name="told")
            self.check = self._check()

    def _scope(self):
        return _Collected(self.graph, f"{self.label}/{_SCOPE}/")

    def guard(self, copied):
        """Puts a tripwire before each op of ``copied`` (the original step's ops that the
        compiled program copies) whose run changes what the compiled steps see: one a kind
        of effect and place (outside control flow, a v1 cond's branch, ...)."""
        groups = collections.defaultdict(list)
        for op in copied:
            effect = effect_of(op)
            if effect is None:
                continue
            context = op._get_control_flow_context()  # noqa: SLF001
            if context is not None and not isinstance(
                    context, (control_flow_ops.CondContext, control_flow_ops.WhileContext)):
                continue  # (an XLA context: no tripwire can enter it)
            branches = _drawing_branches(op) if op.type in _CONDS else ()
            if branches and all(branches):
                branches = ()
            place = (effect, context, op if branches else None)
            groups[place].append(op)
        for (effect, context, cond), ops in groups.items():
            key = len(self.groups)
            self.groups.append((effect, [what for op in ops for what in _named(op, effect)]))
            with self._scope():
                wire = self._wire(key, EFFECTS.index(effect), context, cond)
            for op in ops:
                op._add_control_input(wire)  # noqa: SLF001 (the original op waits for it)

    def _wire(self, key, effect, context, cond):
        """The insert of ``key`` (its ``effect`` the value) into the ran table, run
        where the ops run: inside their v1 ``context``; for a functional ``cond`` whose
        one branch draws, only when that branch is taken."""
        if context is not None:
            context.Enter()
        try:
            insert = tf.raw_ops.LookupTableInsertV2(
                table_handle=self.ran, keys=tf.constant([key], tf.int64),
                values=tf.constant([effect], tf.int64), name="wire")
        finally:
            if context is not None:
                context.Exit()
        if cond is None:
            return insert
        then_draws, _ = _drawing_branches(cond)
        with tf.control_dependencies(None):
            return _when(cond.inputs[0], then_draws, insert)

    def _check(self):
        """What the compiled program's first step waits on: in a run where a key of the
        ran table is not yet in the warned table, a warning for each of the new keys'
        effects not yet told in the session (the told table), then the keys' inserts.
        (Every key warned was ran's: ran holds a new key iff it holds more.)"""
        new = tf.greater(tf.raw_ops.LookupTableSizeV2(table_handle=self.ran),
                         tf.raw_ops.LookupTableSizeV2(table_handle=self.warned))
        lock = threading.Lock()

        def warn(keys, effects, warned, told):  # (the masks in numpy: a dead branch
            with lock:  # costs a run each of its nodes, and boolean_mask is ten)
                ran = collections.defaultdict(list)  # effect -> the ops of its new keys
                for key, effect, before in zip(keys[warned < 0], effects[warned < 0],
                                               told[warned < 0]):
                    if before < 0:
                        ran[effect] += self.groups[key][1]
                for effect, ops in ran.items():
                    warnings.warn(ran_message(self.label, ops, EFFECTS[effect])
                                  + _summarized(self.graph, ops), OriginalOpRanWarning,
                                  stacklevel=2)
            return np.bool_(True)

        def said(pivot):
            with tf.control_dependencies([pivot]):
                keys, effects = tf.raw_ops.LookupTableExportV2(
                    table_handle=self.ran, Tkeys=tf.int64, Tvalues=tf.int64)
            found = [tf.raw_ops.LookupTableFindV2(table_handle=table, keys=k,
                                                  default_value=tf.constant(-1, tf.int64))
                     for table, k in ((self.warned, keys), (self.told, effects))]
            told = tf.numpy_function(warn, [keys, effects] + found, tf.bool, stateful=True,
                                     name="warn")
            with tf.control_dependencies([told]):
                return tf.group(
                    tf.raw_ops.LookupTableInsertV2(table_handle=self.told, keys=effects,
                                                   values=effects),
                    tf.raw_ops.LookupTableInsertV2(table_handle=self.warned, keys=keys,
                                                   values=keys))

        return _when(new, True, said, name="check")


def _named(op, effect):
    """``op`` as ``"'name' (Type)"``; a call or cond that draws, as the random ops it
    calls."""
    if effect is RANDOM and not graph_lib.is_stateful_random(op):
        return graph_lib.stateful_random_ops([op])
    return [f"'{op.name}' ({op.type})"]


def _when(pred, value, body, name="when"):
    """An op that runs ``body`` (an op, or a function of the pivot that builds one) only
    in a run where ``pred`` is ``value``, itself always live: a v1 cond of Switch and
    Merge built directly (no function graph: cheap, and the same in both preambles)."""
    off, on = tf.raw_ops.Switch(data=tf.constant(0), pred=pred)
    if not value:
        off, on = on, off
    pivot = tf.identity(on, name=f"{name}_taken")
    if callable(body):
        body = body(pivot)
    else:
        body._add_control_input(pivot.op)  # noqa: SLF001
    with tf.control_dependencies([body]):
        taken = tf.identity(pivot)
    return tf.raw_ops.Merge(inputs=[tf.identity(off), taken], name=name).output.op


class _Collected:
    """A name scope outside any control dependency whose new ops join ``TRIPWIRES``."""

    def __init__(self, graph, scope):
        self.graph, self.scope = graph, scope

    def __enter__(self):
        self.first = len(self.graph.get_operations())
        self.scopes = [self.graph.as_default(), tf.name_scope(self.scope),
                       tf.control_dependencies(None)]
        for scope in self.scopes:
            scope.__enter__()

    def __exit__(self, *exc):
        for scope in reversed(self.scopes):
            scope.__exit__(*exc)
        for op in self.graph.get_operations()[self.first:]:
            self.graph.add_to_collection(TRIPWIRES, op)


def _summarized(graph, ops):
    """Where a summary op of the graph's SUMMARIES collection reads one of ``ops``
    (``"'name' (Type)"`` strings): the sentence that names it and the hook that runs such
    summaries (a ``MonitoredTrainingSession`` with a ``checkpoint_dir`` adds a
    ``SummarySaverHook`` that runs ``merge_all()`` every ``save_summaries_steps``); else
    ""."""
    names = {what.split("'")[1] for what in ops}
    summaries = [t.op for t in graph.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)
                 if hasattr(t, "op")]
    for summary in summaries:
        if names & {op.name for op in graph_lib.ancestors([summary])}:
            return (f" It is read by the summary {summary.name!r}: a "
                    f"MonitoredTrainingSession with a checkpoint_dir adds a "
                    f"SummarySaverHook that runs the graph's summaries every "
                    f"save_summaries_steps, beside the compiled run. Make the session with "
                    f"ms.hooks.monitored_training_session (it writes the compiled steps' "
                    f"summaries), or pass save_summaries_steps=None.")
    return ""


def is_tripwire_name(name):
    """Whether a node named ``name`` (a partition graph's) is a tripwire's."""
    return f"/{_SCOPE}/" in name


def ran_message(label, ops, effect):
    """``OriginalOpRanWarning``'s message: which original ops (``"'name' (Type)"``
    strings, of which one or more ran) ran, what that did, the fix."""
    what = (f"the original op {ops[0]}" if len(ops) == 1 else
            f"an original op ({graph_lib.named_few(ops)})")
    return (f"{label}: {what} of the step that "
            f"{label} compiled ran beside the compiled program, and {effect}. A "
            f"TensorFlow hook that fetches the original loss (NanTensorHook, "
            f"LoggingTensorHook, a summary) or an evaluation sess.run through the "
            f"original forward pass does this: give TensorFlow's hooks the compiled "
            f"per-step values (fused.values, fused.losses) or use ms.hooks, and "
            f"evaluate with ops of their own (a copy of the forward pass without "
            f"the training switch's random ops).")
