"""Graph checks for fused training steps.

The one rule (DESIGN.md): inner step k must compute its loss, gradients and
hyper-parameters from reads of the trained state made *after* step k-1's apply.
A read that is not ordered after that apply runs once per ``sess.run``, so
every inner step would silently reuse the values from before the run.

How a "read" looks in a graph:

* resource variable: an op that takes the variable's handle as input
  (``ReadVariableOp``, ``ResourceGather``, ...), except metadata ops;
* ref variable: an op that consumes the variable's ref tensor, or an
  ``Identity`` of it. ``Identity`` of a ref tensor aliases the variable's buffer,
  so the real read happens when its consumer runs: the ``w/read`` snapshot made
  with every ref variable is transparent here, and its consumers are checked.
"""

import importlib.util
import os
import sys
import warnings

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

__all__ = ["ALIAS_OPS", "CALL_OPS", "StaleForwardError", "ancestors", "built_at", "captures",
           "check_built_outside", "check_captures", "check_dangling", "is_stateful_random",
           "is_write",
           "order_as_built", "program_nodes", "ref_variable_of", "source_op",
           "stateful_random_ops", "user_stacklevel", "warn_random_under_xla",
           "warn_stateful_random", "watched_variables", "written_variables"]

# Ops that take a variable as input without reading its value.
_METADATA_OPS = frozenset({"VariableShape", "VarIsInitializedOp", "IsVariableInitialized"})
# Ops that pass a variable through without reading it (they alias it); v1 control flow's
# frame ops pass a ref or a handle into a loop or cond body.
ALIAS_OPS = frozenset({"Identity", "Enter", "RefEnter", "RefIdentity"})
# Ops that run a function (tf.cond's If, tf.case, a v2 tf.while_loop, a tf.function call):
# lowered before they run, after which each op inside waits only for the inputs it uses and
# for the call's control inputs, not for all of the call's inputs.
CALL_OPS = frozenset({"If", "StatelessIf", "Case", "StatelessCase", "While", "StatelessWhile",
                      "PartitionedCall", "StatefulPartitionedCall"})
_REF_VARIABLE_OPS = frozenset({"VariableV2", "Variable"})
# Stateful ops that only read state (or make a variable): never "dangling".
_READ_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VarHandleOp",
                       "VariableV2", "Variable", "_ReadVariablesOp"}) | _METADATA_OPS
# Ops that write the variable given as their first input (resource handle or ref).
_WRITE_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter",
                   "ResourceStridedSliceAssign", "Scatter", "Apply", "SparseApply",
                   "StridedSliceAssign")
_STATEFUL_RANDOM_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomShuffle", "Multinomial", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2", "RandomCrop",
})


class StaleForwardError(ValueError):
    """A fused step reads trained state that is not ordered after the previous apply."""


def source_op(tensor):
    """The op whose storage ``tensor`` aliases (follows ``Identity`` chains)."""
    while tensor.op.type in ALIAS_OPS:
        tensor = tensor.op.inputs[0]
    return tensor.op


def ref_variable_of(tensor):
    """The ``VariableV2`` op whose buffer ``tensor`` aliases (a ref variable's ``w/read``
    snapshot, or its ``Enter`` into a v1 loop), or None."""
    if tensor.dtype == tf.resource:
        return None
    source = source_op(tensor)
    return source if source.type in _REF_VARIABLE_OPS else None


def _read_of(op, watched):
    """The name of a watched variable that ``op`` reads, or None."""
    if op.type in ALIAS_OPS or op.type in _METADATA_OPS:
        return None
    for tensor in op.inputs:
        name = watched.get(source_op(tensor))
        if name is not None:
            return name
    return None


def _preds(op):
    return [t.op for t in op.inputs] + list(op.control_inputs)


def _data_preds(op):
    return [t.op for t in op.inputs]


def is_write(op):
    """Whether ``op`` writes the variable that is its first input."""
    return op.type.startswith(_WRITE_PREFIXES) and len(op.inputs) > 0


def written_variables(ops):
    """Map from the op that owns each variable that one of ``ops`` writes to its name."""
    written = {}
    for op in ops:
        if is_write(op):
            source = source_op(op.inputs[0])
            written[source] = source.name
    return written


def order_as_built(ops):
    """Orders every read and write of a resource variable among ``ops`` as they were built
    (each write after the accesses before it, each access after the write before it), the
    order tf.function's automatic control dependencies give them. A graph orders two ops
    only by its edges: a read and a write of one variable without one may run either way."""
    last_write, reads = {}, {}
    for op in ops:
        handles = {source_op(t) for t in op.inputs if t.dtype == "resource"}
        for handle in handles:
            before = [last_write[handle]] if handle in last_write else []
            if is_write(op) and source_op(op.inputs[0]) is handle:
                before += reads.pop(handle, [])
                last_write[handle] = op
            elif op.type in _READ_OPS:
                reads.setdefault(handle, []).append(op)
            else:
                continue
            missing = [b for b in before if b is not op and b not in op.control_inputs]
            if missing:
                op._add_control_inputs(missing)  # noqa: SLF001 (TensorFlow's own auto_control_deps does this)


def ancestors(roots):
    """Every op that one of ``roots`` depends on, ``roots`` included."""
    seen, stack = set(), list(roots)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend(_preds(op))
    return seen


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
            stack.extend(p for p in _preds(op) if p in own)
    for op in ops:
        if (op not in reached and op not in exempt and op.type not in _READ_OPS
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


def _ancestors_postorder(root, stop=None, known=(), preds=_preds):
    """Ancestors of ``root`` (inclusive), each after all of its inputs; ``stop`` (an op or
    a set of them) is not expanded, and ops in ``known`` (already visited by an earlier
    walk) are left out.
    ``preds``: an op's predecessors (default: data and control inputs)."""
    stops = stop if isinstance(stop, (set, frozenset)) else {stop}
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        op, expanded = stack.pop()
        if expanded:
            order.append(op)
            continue
        if op in seen or op in known:
            continue
        seen.add(op)
        stack.append((op, True))
        if op not in stops:
            stack.extend((pred, False) for pred in preds(op) if pred not in seen)
    return order


def watched_variables(variables):
    """Map from the op that owns each variable's storage to the variable's name."""
    return {v.op: v.op.name for v in variables}


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
    for op in _ancestors_postorder(end):
        if op not in before:
            found += [(op, pred) for pred in _data_preds(op) if stale.get(pred)]
            continue
        var = _read_of(op, watched)
        stale[op] = (var, op) if var is not None else next(
            (stale[p] for p in _data_preds(op) if stale.get(p)), None)
    if found:  # named as the forward pass uses it (a gradient may use the read inside it)
        _, used = min(found, key=lambda pair: (  # noqa: SLF001 (_id: creation order)
            "/gradients/" in pair[0].name, pair[0]._id))
        raise StaleForwardError(_stale_message("2..N" if loop else 2, used, *stale[used],
                                               name=name, loop=loop))


def captures(body):
    """The outside tensors a function graph (a loop body, a compiled program) uses."""
    return list(body.external_captures)


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
        for op in _ancestors_postorder(tensor.op, known=stale, preds=_data_preds):
            var = _read_of(op, watched)
            stale[op] = (var, op) if var is not None else next(
                (stale[p] for p in _data_preds(op) if stale.get(p)), None)
        if stale[tensor.op]:
            raise StaleForwardError(_stale_message("2..N", tensor.op, *stale[tensor.op],
                                                   name=name, loop=True))


def program_nodes(func_graph):
    """Every NodeDef of ``func_graph`` and of the functions it calls (loop bodies, cond
    branches, theirs in turn), as one list: those of its library, and those a node
    imported into it calls from the graphs around it (where they were built)."""
    graph_def = func_graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    nodes, seen, todo = list(graph_def.node), set(), list(graph_def.node)
    while todo:
        node = todo.pop()
        for value in node.attr.values():
            for name in [value.func.name] + [f.name for f in value.list.func]:
                if not name or name in seen:
                    continue
                seen.add(name)
                function = library.get(name) or _outer_function(func_graph, name)
                if function is not None:
                    nodes += function.node_def
                    todo += function.node_def
    return nodes


def _outer_function(graph, name):
    """The FunctionDef ``name`` of a graph around ``graph``, or None."""
    while graph is not None:
        function = graph._functions.get(name)  # noqa: SLF001 (no public lookup by name)
        if function is not None:  # (a v1 Defun's: .definition)
            return getattr(function, "cached_definition", None) or function.definition
        graph = getattr(graph, "outer_graph", None)
    return None


def warn_random_under_xla(func_graph, *, name):
    """Warn when an XLA-compiled program draws random numbers: XLA's stateless random
    kernels draw other numbers than TensorFlow's, so single steps cannot match."""
    nodes = program_nodes(func_graph)
    found = sorted({n.op for n in nodes if n.op.startswith("StatelessRandom")
                    or n.op.startswith("StatelessTruncated")})
    if found:
        warnings.warn(
            f"{name}: the XLA-compiled steps draw random numbers ({', '.join(found)}); XLA's "
            f"kernels draw different numbers than TensorFlow's for the same seed, so these "
            f"steps will not match single steps without XLA (ms.verify will report it). "
            f"The draws are still a deterministic function of the seed and the step.",
            RuntimeWarning, stacklevel=user_stacklevel())


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


def is_stateful_random(op):
    """Whether ``op`` draws from a random stream that advances per kernel call (its
    ``seed``/``seed2`` attributes only start it): dropout's ``RandomUniform``, the
    ``*CandidateSampler`` ops of ``nce_loss`` and ``sampled_softmax_loss``,
    ``RandomShuffle``, ``Multinomial``, ... Every stateful op TensorFlow registers with
    those two attributes is one; stateless ops (``StatelessRandom*``) take their seed
    as an input, and a ``tf.random.Generator``'s draws follow its state variable."""
    return _is_stateful_random_type(op.type)


def _is_stateful_random_type(op_type):
    if op_type in _STATEFUL_RANDOM_OPS:
        return True
    op_def = op_def_registry.get(op_type)
    return (op_def is not None and op_def.is_stateful
            and {"seed", "seed2"} <= {a.name for a in op_def.attr})


def called_functions(node_def):
    """The names of the functions a node calls (a cond's branches, a loop's body and
    condition, a call's function)."""
    for attr in node_def.attr.values():
        if attr.HasField("func"):
            yield attr.func.name
        yield from (f.name for f in attr.list.func)


def stateful_random_ops(ops):
    """The stateful random ops among ``ops`` and inside the functions they call (a
    ``tf.cond`` or ``tf.while_loop`` under v2 control flow, a ``tf.function``), as
    ``'name' (Type)`` strings, sorted. A ``tf.data`` op's functions (its ``map``) are
    the pipeline's, not the step's, and are not searched."""
    found = set()
    for op in ops:
        if is_stateful_random(op):
            found.add(f"'{op.name}' ({op.type})")
        if "Dataset" in op.type or "Iterator" in op.type:
            continue
        queue, seen = list(called_functions(op.node_def)), set()
        while queue:
            name = queue.pop()
            function = None if name in seen else _outer_function(op.graph, name)
            seen.add(name)
            for node in function.node_def if function is not None else ():
                if _is_stateful_random_type(node.op):
                    found.add(f"'{node.name}' ({node.op}) in a function {op.name!r} calls")
                queue.extend(called_functions(node))
    return sorted(found)


def stateless_replacement(found):
    if any("CandidateSampler" in what for what in found):
        return ("For nce_loss and sampled_softmax_loss, pass sampled_values= from a "
                "stateless sampler keyed on the global step: "
                "ms.sampling.log_uniform_candidates(labels, num_sampled, num_classes, "
                "seed=tf.stack([seed, global_step])) (the guide 'Building steps from a loss function' shows it).")
    return ("Use stateless ops keyed on the global step instead, e.g. "
            "tf.random.stateless_uniform(shape, seed=tf.stack([seed, global_step])).")


def warn_stateful_random(step_root, *, name):
    """Warn when ``step_root`` depends on stateful random ops (dropout, a candidate
    sampler), naming them and the stateless replacement."""
    found = stateful_random_ops(_ancestors_postorder(step_root))
    if found:
        warnings.warn(
            f"{name}: loss_fn uses stateful random ops ({', '.join(found[:3])}"
            f"{', ...' if len(found) > 3 else ''}); their draws depend on how many "
            f"sess.run calls were made, so fused and single-step results will "
            f"differ and ms.verify will fail. {stateless_replacement(found)}",
            RuntimeWarning, stacklevel=user_stacklevel())



def built_at(op):
    """`` at FILE:LINE (in FUNCTION)``: the last frame of ``op``'s creation traceback that
    is the user's (outside multistep and TensorFlow), or "" if there is none. TensorFlow
    drops a given name in places (``assign_add`` on a resource variable names its op
    ``AssignAddVariableOp``), so an op's name alone may not lead back to the user's code."""
    frames = [f for f in (op.traceback or ()) if not f.filename.startswith(_INTERNAL)]
    if not frames:
        return ""
    frame = frames[-1]
    return f" at {frame.filename}:{frame.lineno} (in {frame.name})"


def _package_dirs(*names):
    """The directories of the installed packages ``names`` (found, not imported)."""
    found = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            found += [os.path.abspath(p) + os.sep for p in spec.submodule_search_locations]
    return tuple(found)


# Frames that are not the user's: multistep's, TensorFlow's, and the libraries whose ops a
# user's line builds through (TensorBoard's tf.summary, Keras and tf-keras layers).
_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             os.path.dirname(os.path.abspath(tf.__file__)) + os.sep,
             *_package_dirs("tensorboard", "keras", "tf_keras"))
# TF2 tf.summary ops (summary_ops_v2): in a TF1 graph they write only when fetched.
_V2_SUMMARY_OPS = frozenset({"WriteSummary", "WriteScalarSummary", "WriteHistogramSummary",
                             "WriteImageSummary", "WriteAudioSummary", "WriteRawProtoSummary",
                             "WriteGraphSummary"})


def user_stacklevel():
    """``warnings.warn``'s ``stacklevel`` that points at the caller's first frame outside
    multistep and TensorFlow (the user's ``ms.unroll`` call, however deep the builder is:
    under XLA it builds inside ``tf.function``'s tracing)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
