"""Graph walks every part shares: what reads, writes and aliases a variable, an op's
ancestors, the order ops were built in, the functions a node calls, the stateful random
ops a program draws from, and where the user built an op.

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

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

__all__ = ["ALIAS_OPS", "CALL_OPS", "READ_OPS", "STATEFUL_RANDOM_OPS", "ancestors",
           "ancestors_postorder", "built_at", "called_functions", "captures", "data_preds",
           "global_step_variable", "is_stateful_random", "is_write", "named_few", "order_as_built",
           "unordered_state_reads",
           "outer_function", "preds", "program_nodes", "random_in_functions", "read_of",
           "ref_variable_of", "source_op",
           "stateful_random_ops", "stateless_replacement", "user_stacklevel", "watched_variables",
           "written_variables"]

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
READ_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VarHandleOp",
                       "VariableV2", "Variable", "_ReadVariablesOp"}) | _METADATA_OPS
# Ops that write the variable given as their first input (resource handle or ref).
_WRITE_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter",
                   "ResourceStridedSliceAssign", "Scatter", "Apply", "SparseApply",
                   "StridedSliceAssign")
STATEFUL_RANDOM_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomShuffle", "Multinomial", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2", "RandomCrop",
})


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


def read_of(op, watched):
    """The name of a watched variable that ``op`` reads, or None."""
    if op.type in ALIAS_OPS or op.type in _METADATA_OPS:
        return None
    for tensor in op.inputs:
        name = watched.get(source_op(tensor))
        if name is not None:
            return name
    return None


def preds(op):
    return [t.op for t in op.inputs] + list(op.control_inputs)


def data_preds(op):
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
            elif op.type in READ_OPS:
                reads.setdefault(handle, []).append(op)
            else:
                continue
            missing = [b for b in before if b is not op and b not in op.control_inputs]
            if missing:
                op._add_control_inputs(missing)  # noqa: SLF001 (TensorFlow's own auto_control_deps does this)


_VARIABLE_OPS = frozenset({"VarHandleOp"}) | _REF_VARIABLE_OPS
_BACK_EDGES = frozenset({"NextIteration", "RefNextIteration"})


def unordered_state_reads(ops):
    """The races among ``ops`` (a step's) that reach its variables: each ``(read, write,
    variable op, a write the read goes to)`` where ``read`` reads a variable that ``write``
    writes (an apply, an ``assign_add``) with no path between the two either way, and
    ``read``'s value goes on, along data edges, into a write of a variable (an EMA's
    shadow, a moving average). TensorFlow's executor runs such a pair in whichever order
    it is ready in, run by run, so the state a single step leaves is not a function of
    its inputs: the pre-2017 CIFAR-10 tutorial's EMA, grouped beside the apply instead of
    after it. A read whose value only goes to a fetch (a summary of a weight), or only
    orders other ops (a control edge), or ends in another kind of state whose use of it
    the walk cannot judge (an accumulator's ``local_step``) is not one.

    Reachability is kept as bitsets of variable writes per op (one bit a write, so a walk
    is one pass forwards and one backwards, whatever the number of reads); a v1 loop's
    back edges (``NextIteration``) are left out (its frame orders what is inside)."""
    members = set(ops)
    writes, bit, written = [], {}, {}  # written: variable op -> its writes' bits
    for op in ops:
        source = source_op(op.inputs[0]) if is_write(op) else None
        if source is not None and source.type in _VARIABLE_OPS:
            bit[op] = 1 << len(writes)
            written[source] = written.get(source, 0) | bit[op]
            writes.append(op)
    if not writes:
        return []

    def inside(op):  # an op's predecessors among ``ops``, a loop's back edges left out
        return [pred for pred in preds(op) if pred in members and pred.type not in _BACK_EDGES]

    order, seen = [], set()  # each op after its predecessors (not creation order: an
    for op in ops:  # edge can be added to an op after it was built)
        walk = ancestors_postorder(op, known=seen, preds=inside)
        order += walk
        seen.update(walk)
    consumers = {op: [] for op in ops}  # along data and control edges
    data_consumers = {op: set() for op in ops}
    above = {}  # op -> the writes it depends on
    for op in order:
        above[op] = 0
        for pred in inside(op):
            consumers[pred].append(op)
            above[op] |= above[pred] | bit.get(pred, 0)
        for pred in data_preds(op):
            if pred in members and pred.type not in _BACK_EDGES:
                data_consumers[pred].add(op)
    below, fed = {}, {}  # op -> the writes that depend on it; that its value goes into
    for op in reversed(order):
        below[op] = fed[op] = 0
        for consumer in consumers[op]:
            below[op] |= below.get(consumer, 0) | bit.get(consumer, 0)
        for consumer in data_consumers[op]:
            fed[op] |= fed.get(consumer, 0) | bit.get(consumer, 0)

    def first(mask):
        return writes[(mask & -mask).bit_length() - 1]

    races = []
    for op in order:  # a write reads what it writes from its other inputs (an Assign of
        into = fed[op] | bit.get(op, 0)  # a ref variable takes the weight it copies)
        if op.type in ALIAS_OPS or op.type in _METADATA_OPS or not into:
            continue
        for tensor in op.inputs[1:] if op in bit else op.inputs:
            source = source_op(tensor)
            unordered = written.get(source, 0) & ~(above[op] | below[op])
            if unordered:
                races.append((op, first(unordered), source, first(into)))
                break
    return races


def ancestors(roots):
    """Every op that one of ``roots`` depends on, ``roots`` included."""
    seen, stack = set(), list(roots)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend(preds(op))
    return seen


def ancestors_postorder(root, stop=None, known=(), preds=preds):
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


def captures(body):
    """The outside tensors a function graph (a loop body, a compiled program) uses."""
    return list(body.external_captures)


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
                function = library.get(name) or outer_function(func_graph, name)
                if function is not None:
                    nodes += function.node_def
                    todo += function.node_def
    return nodes


def outer_function(graph, name):
    """The FunctionDef ``name`` of a graph around ``graph``, or None."""
    while graph is not None:
        function = graph._functions.get(name)  # noqa: SLF001 (no public lookup by name)
        if function is not None:  # (a v1 Defun's: .definition)
            return getattr(function, "cached_definition", None) or function.definition
        graph = getattr(graph, "outer_graph", None)
    return None


def is_stateful_random(op):
    """Whether ``op`` draws from a random stream that advances per kernel call (its
    ``seed``/``seed2`` attributes only start it): dropout's ``RandomUniform``, the
    ``*CandidateSampler`` ops of ``nce_loss`` and ``sampled_softmax_loss``,
    ``RandomShuffle``, ``Multinomial``, ... Every stateful op TensorFlow registers with
    those two attributes is one; stateless ops (``StatelessRandom*``) take their seed
    as an input, and a ``tf.random.Generator``'s draws follow its state variable."""
    return _is_stateful_random_type(op.type)


def _is_stateful_random_type(op_type):
    if op_type in STATEFUL_RANDOM_OPS:
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
        found.update(f"'{node.name}' ({node.op}) in a function {op.name!r} calls"
                     for node in random_in_functions(op.graph, called_functions(op.node_def)))
    return sorted(found)


def random_in_functions(graph, names):
    """The stateful random nodes (``NodeDef``) of the functions ``names`` of ``graph``
    and of the functions they call."""
    queue, seen = list(names), set()
    while queue:
        name = queue.pop()
        function = None if name in seen else outer_function(graph, name)
        seen.add(name)
        for node in function.node_def if function is not None else ():
            if _is_stateful_random_type(node.op):
                yield node
            queue.extend(called_functions(node))


def stateless_replacement(found):
    if any("CandidateSampler" in what for what in found):
        return ("For nce_loss and sampled_softmax_loss, pass sampled_values= from a "
                "stateless sampler keyed on the global step: "
                "ms.sampling.log_uniform_candidates(labels, num_sampled, num_classes, "
                "seed=tf.stack([seed, global_step])) (the guide 'Building steps from a loss function' shows it).")
    return ("Use stateless ops keyed on the global step instead, e.g. "
            "tf.random.stateless_uniform(shape, seed=tf.stack([seed, global_step])).")


def global_step_variable(graph):
    """The graph's global step as a variable: the one in the ``GLOBAL_STEP`` collection,
    else the one integer variable named ``global_step`` (``tf.Variable(0,
    name="global_step", trainable=False)`` passed to ``minimize(global_step=...)``, which
    TensorFlow's ``get_global_step`` finds only as a tensor, and refuses when it is a
    resource variable's handle); or None."""
    collected = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_STEP)
    if len(collected) == 1 and isinstance(collected[0], tf.Variable):
        return collected[0]
    named = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
             if v.op.name.rpartition("/")[2] == "global_step" and v.dtype.base_dtype.is_integer]
    return named[0] if len(named) == 1 else None


def named_few(items, shown=3):
    """``items`` (strings) joined, the first ``shown`` of them and how many more:
    ``"'a', 'b', 'c' and 2 more"``."""
    items = list(items)
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


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


def user_stacklevel():
    """``warnings.warn``'s ``stacklevel`` that points at the caller's first frame outside
    multistep and TensorFlow (the user's ``ms.unroll`` call, however deep the builder is:
    under XLA it builds inside ``tf.function``'s tracing)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
