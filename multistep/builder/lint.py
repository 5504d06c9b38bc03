"""The builder's rules for a step built from a loss function: the stale forward pass
(a value computed before the previous apply), the dangling stateful op (built by a step,
run by nothing), captures a loop body evaluates once, and stateful random draws.

The one rule (DESIGN.md): inner step k must compute its loss, gradients and
hyper-parameters from reads of the trained state made *after* step k-1's apply.
A read that is not ordered after that apply runs once per ``sess.run``, so
every inner step would silently reuse the values from before the run. What a read
and a write look like in a graph is ``multistep.graph``'s.
"""

import warnings

import tensorflow as tf

from multistep.compiler import streams as streams_lib
from multistep.graph import (CALL_OPS, READ_OPS, ancestors_postorder, built_at, captures,
                             data_preds, preds, read_of, source_op, stateful_random_ops,
                             stateless_replacement, user_stacklevel)

__all__ = ["StaleForwardError", "check_built_outside", "check_captures", "check_dangling",
           "warn_stateful_random"]

# TF2 tf.summary ops (summary_ops_v2): in a TF1 graph they write only when fetched.
_V2_SUMMARY_OPS = frozenset({"WriteSummary", "WriteScalarSummary", "WriteHistogramSummary",
                             "WriteImageSummary", "WriteAudioSummary", "WriteRawProtoSummary",
                             "WriteGraphSummary"})


class StaleForwardError(ValueError):
    """A fused step reads trained state that is not ordered after the previous apply."""



def check_dangling(ops, end, *, exempt, name, step):
    """Raise ValueError if one of ``ops`` (those a step built) is stateful but neither
    ``end`` (the op that ends the step) nor anything it depends on needs it: it would
    never run. Reads, variables and the ops in ``exempt`` are not flagged. Only the
    step's own ops are walked, so the check costs the step's size, not the graph's."""
    own = set(ops)
    reached, stack = set(), [end] if end in own else []
    while stack:
        op = stack.pop()
        if op not in reached:
            reached.add(op)
            stack.extend(p for p in preds(op) if p in own)
    for op in ops:
        if (op not in reached and op not in exempt and op.type not in READ_OPS
                and getattr(op, "_is_stateful", False)):
            if "/after_apply/" in op.name:
                raise ValueError(
                    f"{name}: after_apply builds the stateful op '{op.name}' ({op.type})"
                    f"{built_at(op)} at inner step {step}, but does not return it, so it would "
                    f"never run. Return it from after_apply (an op, a tensor or a list of them, "
                    f"e.g. after_apply=lambda: [w.assign(tf.clip_by_norm(w, 1.0))]): what "
                    f"after_apply returns runs after each step's apply, before the next step.")
            if op.type in _V2_SUMMARY_OPS:
                raise ValueError(
                    f"{name}: inner step {step} builds the TF2 summary op '{op.name}' "
                    f"({op.type}){built_at(op)}. In a TF1 graph a TF2 tf.summary op writes "
                    f"only when fetched (a single step fetches "
                    f"tf.compat.v1.summary.all_v2_summary_ops() beside its train op), and a "
                    f"fused run cannot fetch one op per inner step. Write it with "
                    f"tf.compat.v1.summary.scalar (or histogram, ...) instead: unrolled.summaries "
                    f"holds each inner step's, and ms.hooks.StepSummaryHook writes each at its "
                    f"step's global step.")
            raise ValueError(
                f"{name}: inner step {step} builds the stateful op '{op.name}' ({op.type})"
                f"{built_at(op)}, but "
                f"nothing the step runs depends on it, so it would never run (nor would it in a "
                f"single-step graph built the same way). To run it in every step: add it to "
                f"tf.compat.v1.GraphKeys.UPDATE_OPS inside loss_fn (update_ops=True runs those "
                f"after the step's forward pass, before its apply), or build it in after_apply "
                f"(run after the step's apply). Layers that write state in their forward pass "
                f"without UPDATE_OPS (Keras 3 BatchNormalization and Dropout in graph mode) need "
                f"update_ops='all': every variable write of the forward pass then runs in its "
                f"step, as tf.function would run it; so do tf-keras layers called with a "
                f"`training` placeholder, whose updates are conds holding the writes.")



def check_built_outside(end, before, watched, *, name, loop=False):
    """Raise StaleForwardError if the step that ``end`` ends uses a value built outside it
    (among the ops ``before`` it) that reads watched state: a tensor ``loss_fn`` did not
    build itself (``logits = dense(x)`` made once, a learning rate computed from the
    global step outside). ``ms.unroll``'s contract is that ``loss_fn`` builds the forward
    pass, and a graph of N steps that reused such a value would train on stale weights.
    The compiler would copy it into every step, as ``ms.compile`` does a program as
    written; ``ms.unroll`` refuses it rather than guess what was meant."""
    stale = {}  # op outside the step -> (variable name, read op) in its ancestry, or None
    found = []  # (the op of the step that uses it, the stale op)
    for op in ancestors_postorder(end):
        if op not in before:
            found += [(op, pred) for pred in data_preds(op) if stale.get(pred)]
            continue
        var = read_of(op, watched)
        stale[op] = (var, op) if var is not None else next(
            (stale[p] for p in data_preds(op) if stale.get(p)), None)
    if found:  # named as the forward pass uses it (a gradient may use the read inside it)
        _, used = min(found, key=lambda pair: (  # noqa: SLF001 (_id: creation order)
            "/gradients/" in pair[0].name, pair[0]._id))
        raise StaleForwardError(_stale_message("2..N" if loop else 2, used, *stale[used],
                                               name=name, loop=loop))



def check_captures(body, watched, *, name):
    """Raise StaleForwardError if ``body`` (a function graph: a loop body or compiled
    program) captures an outside tensor computed from a read of watched state.

    Such a tensor is evaluated once, before the loop or program starts, so
    every step inside would reuse it. Captured variable handles are fine: the
    reads they feed happen inside. Only data inputs are followed: a control input
    orders a capture (a constant built after step 1, say), it carries no value.
    """
    stale = {}  # op -> (variable name, read op) in its ancestry, or None
    for tensor in captures(body):
        if not tf.is_symbolic_tensor(tensor):
            continue  # an eager value: no graph history (multistep.tf2 reports it as frozen)
        if source_op(tensor) in watched:
            continue  # a variable handle (or its ref): read inside the body
        # Shared ancestry is walked once.
        for op in ancestors_postorder(tensor.op, known=stale, preds=data_preds):
            var = read_of(op, watched)
            stale[op] = (var, op) if var is not None else next(
                (stale[p] for p in data_preds(op) if stale.get(p)), None)
        if stale[tensor.op]:
            raise StaleForwardError(_stale_message("2..N", tensor.op, *stale[tensor.op],
                                                   name=name, loop=True))



def _stale_message(step, used, var, read_op, *, name, loop=False):
    where = f"'{used.name}' ({used.type}){built_at(used)}"
    if read_op is not used:
        where += f", computed from a read of '{var}' by '{read_op.name}' ({read_op.type})"
    else:
        where += f", a read of '{var}'"
    order = ("is computed once, before the loop" if loop
             else f"is not ordered after step {step - 1}'s apply")
    if read_op.type in CALL_OPS and not loop:
        why = (f"'{read_op.name}' reads it inside a cond, loop or function call, which runs "
               f"lowered: each op inside waits for the call's control inputs and the inputs "
               f"it uses itself, and no control input of the call follows step {step - 1}'s "
               f"apply (it was built outside the step, or ordered only through its data "
               f"inputs), so the read may run before that apply")
    else:
        why = (f"It was built outside the step (outside loss_fn, or from "
               f"a tensor made once), so TensorFlow evaluates it once per sess.run and every "
               f"inner step would reuse the value of '{var}' from before the run")
    graph = used.graph
    held = [key for key in graph.get_all_collection_keys() if isinstance(key, str) and any(
        getattr(x, "op", x) is used for x in graph.get_collection(key))]
    if held:
        why += (f". It came through the graph collection {', '.join(map(repr, held))}: "
                f"every step's loss_fn sees the collection as it was before step 1, with the "
                f"step's own additions, so an item added outside loss_fn is one tensor, made "
                f"once")
    return (
        f"{name}: inner step {step} uses {where}, which {order}. "
        f"{why}: a silently wrong result. Fix: build everything that reads a trained variable inside "
        f"loss_fn (call the layer there, e.g. loss_fn=lambda: xent(dense(x), y)); "
        f"for a learning rate or other hyper-parameter that depends on the global "
        f"step, pass a callable, e.g. learning_rate=lambda: "
        f"tf.compat.v1.train.exponential_decay(0.1, global_step, 10, 0.5)."
    )



def warn_stateful_random(step_root, *, name):
    """Warn when ``step_root`` depends on stateful random ops whose stream is not shared
    (``multistep.compiler.streams``), naming them and why."""
    found = stateful_random_ops(ancestors_postorder(step_root))
    if found:
        warnings.warn(
            f"{name}: {streams_lib.unshared(step_root.graph, found)}: each copy restarts "
            f"it, so the fused steps draw other numbers than single steps (ms.verify "
            f"reports it). {stateless_replacement(found)}",
            RuntimeWarning, stacklevel=user_stacklevel())



