"""The original step's ops beside its compiled program: reported the first time one runs.

After ``ms.compile``, the original train op and forward pass are still in the graph, and a
loop may still run them: a TensorFlow hook that fetches the original loss, an evaluation
``sess.run`` through the original forward pass. Where such a run changes what the compiled
steps see (it takes a batch from the shared iterator, draws from a random op whose stream
the compiled copy does not follow, applies an update of its own), the program no longer
does what it did as written. ``guard`` puts a tripwire before each such original op: a
``numpy_function`` that warns (``OriginalOpRanWarning``), once for each kind of
effect per compiled program, naming the op, what its run did and, where a summary reads
it, the hook that runs the summaries. The compiled copies never run it, and
``ms.compile`` leaves it out of the steps it copies. (An op inside a v1 cond or loop gets
none: a tripwire outside would fire for a branch not taken, and cannot enter a loop's
frame.)
"""

import threading
import warnings

import numpy as np
import tensorflow as tf

from multistep import graph as graph_lib

__all__ = ["OriginalOpRanWarning", "TRIPWIRES", "effect_of", "guard", "is_tripwire_name",
           "ran_message"]

TRIPWIRES = "multistep_tripwires"  # the graph collection of the tripwire ops
_SCOPE = "_original_ran"


class OriginalOpRanWarning(RuntimeWarning):
    """An op of a compiled step's original ran beside the compiled program."""


def effect_of(op):
    """What running the original ``op`` does to the compiled steps, or None if nothing."""
    if graph_lib.is_stateful_random(op):
        return ("drew from its random stream, which the compiled steps' own copy of the op "
                "does not follow: the compiled steps now draw other numbers than the program "
                "as written")
    if op.type.startswith(("IteratorGetNext", "QueueDequeue", "ReaderRead")):
        return ("took a batch of its own from the shared input, which no compiled step "
                "trains on")
    if graph_lib.is_write(op):
        return ("applied an update of its own (an extra step: weights, optimizer slots or "
                "the global step), beside the compiled steps")
    return None


def guard(copied, label):
    """Puts a tripwire before each op of ``copied`` (the original step's ops that the
    compiled program copies) whose run changes what the compiled steps see."""
    fired, lock = set(), threading.Lock()  # one warning per effect per compiled program
    graph = copied[0].graph if copied else None
    for op in copied:
        effect = effect_of(op)
        if effect is None or op._get_control_flow_context() is not None:  # noqa: SLF001
            continue  # (a v1 cond or loop: a tripwire outside it would fire for a branch
            #           not taken, and cannot enter a loop's frame)

        def fire(op_name=op.name, op_type=op.type, effect=effect):
            with lock:
                first = effect not in fired
                fired.add(effect)
            if first:
                warnings.warn(ran_message(label, op_name, op_type, effect)
                              + _summarized(graph, op_name), OriginalOpRanWarning,
                              stacklevel=2)
            return np.bool_(True)

        with graph.as_default(), tf.name_scope(f"{label}/{_SCOPE}/"), \
                tf.control_dependencies(None):
            wire = tf.numpy_function(fire, [], tf.bool, stateful=True, name="wire").op
        graph.add_to_collection(TRIPWIRES, wire)
        op._add_control_input(wire)  # noqa: SLF001 (the original op waits for its tripwire)


def _summarized(graph, op_name):
    """Where a summary op of the graph's SUMMARIES collection reads ``op_name``: the
    sentence that names it and the hook that runs such summaries (a
    ``MonitoredTrainingSession`` with a ``checkpoint_dir`` adds a ``SummarySaverHook``
    that runs ``merge_all()`` every ``save_summaries_steps``); else ""."""
    summaries = [t.op for t in graph.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)
                 if hasattr(t, "op")]
    for summary in summaries:
        if op_name in {op.name for op in graph_lib.ancestors([summary])}:
            return (f" It is read by the summary {summary.name!r}: a "
                    f"MonitoredTrainingSession with a checkpoint_dir adds a "
                    f"SummarySaverHook that runs the graph's summaries every "
                    f"save_summaries_steps, beside the compiled run. Make the session with "
                    f"ms.hooks.monitored_training_session (it writes the compiled steps' "
                    f"summaries), or pass save_summaries_steps=None.")
    return ""


def is_tripwire_name(name):
    """Whether a node named ``name`` (a partition graph's) is a tripwire."""
    return f"/{_SCOPE}/" in name


def ran_message(label, op_name, op_type, effect):
    """``OriginalOpRanWarning``'s message: which original op ran, what that did, the fix."""
    return (f"{label}: the original op {op_name!r} ({op_type}) of the step that "
            f"{label} compiled ran beside the compiled program, and {effect}. A "
            f"TensorFlow hook that fetches the original loss (NanTensorHook, "
            f"LoggingTensorHook, a summary) or an evaluation sess.run through the "
            f"original forward pass does this: give TensorFlow's hooks the compiled "
            f"per-step values (fused.values, fused.losses) or use ms.hooks, and "
            f"evaluate with ops of their own (a copy of the forward pass without "
            f"the training switch's random ops).")
