"""The traps ``ms.tf2.check`` finds in a traced training loop, one function a kind:
stale captures, frozen eager values, Python state that two traces freeze apart, random
draws under XLA; each a ``Finding`` with its message."""

import dataclasses
import inspect

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from multistep import graph as graph_lib
from multistep.builder import lint

__all__ = ["Finding", "capture_findings", "held_constants", "loop_bodies", "python_state_findings",
           "random_ops", "random_under_xla_message", "referenced", "stale_findings",
           "written_variables"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One trap ``check`` found: what, where, and the fix."""

    kind: str  # "stale", "frozen" or "python_state"
    message: str

    @property
    def stale(self):
        return self.kind == "stale"

    def __str__(self):
        return self.message


def loop_bodies(graph):
    """The bodies of the v2 loops in ``graph`` and in the loops and conds nested in it."""
    out, todo = [], [graph]
    while todo:
        for op in todo.pop().get_operations():
            nested = [getattr(op, attr, None) for attr in ("_body_graph", "_true_graph",
                                                           "_false_graph")]
            if op.type in ("While", "StatelessWhile") and nested[0] is not None:
                out.append(nested[0])
            todo += [g for g in nested if g is not None]
    return out


def python_state_findings(fused, batches):
    batch = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), batches)
    graphs = [tf.function(lambda b: fused.step_fn(*fused._arguments(b)), autograph=False)
              .get_concrete_function(batch).graph for _ in range(2)]
    constants = [[(op, tf.make_ndarray(op.get_attr("value"))) for op in g.get_operations()
                  if op.type == "Const"] for g in graphs]
    findings = []
    for (op, a), (_, b) in zip(*constants):
        if a.shape != b.shape or not np.array_equal(a, b):
            findings.append(Finding("python_state", (
                f"step_fn's constant '{op.name}'{graph_lib.built_at(op)} was {a.tolist()} in one "
                f"trace and {b.tolist()} in the next: Python state read in step_fn (a "
                f"counter, an attribute) is frozen at each trace, so every fused step reuses "
                f"one value. Keep it in a tf.Variable and update it inside step_fn.")))
    return findings


def stale_findings(body, written, name="ms.tf2.fuse"):
    """The stale capture of the loop body (a FuncGraph), if any; ``name`` says whose."""
    try:
        lint.check_captures(body, written, name=name)
    except lint.StaleForwardError as error:
        return [Finding("stale", str(error))]
    return []


def capture_findings(body, written, name="ms.tf2.fuse", constants=frozenset()):
    """Stale and frozen captures of the loop body (a FuncGraph); ``name`` says whose;
    ``constants``: ids of eager tensors that are constants by design (``held_constants``)."""
    findings = stale_findings(body, written, name)
    for outer, inner in body.captures:
        # (Only a float can be a value computed from the weights: integer labels, indices
        # and flags captured eagerly are data, not a trap.)
        if tf.is_symbolic_tensor(outer) or not outer.dtype.is_floating or id(outer) in constants:
            continue
        used = _used_at(inner)
        # (an eager value's placeholder is named by a number: no name to show)
        named = "" if inner.op.name.rsplit("/", 1)[-1].isdigit() else f" as '{inner.op.name}'"
        findings.append(Finding("frozen", (
            f"{name}: the loop uses a value computed before the call (shape {outer.shape}, "
            f"{outer.dtype.name}), captured{named}{used}: the same in every "
            f"step and every call. Data may be; anything computed from the weights (a "
            f"gradient, an L2 term) must be computed inside the loop. (A value an optimizer, "
            f"a schedule or a layer holds as an attribute is a constant, not reported.)")))
    return findings


def _used_at(tensor, depth=3):
    """`` at FILE:LINE (in FUNCTION)`` of the user's first op that uses ``tensor``: through
    the functions it is passed to (a ``tf.function`` step, called inside the loop), whose
    own ops were built at the user's lines; "" if none."""
    for op in tensor.consumers():
        where = graph_lib.built_at(op)
        if op.type in ("PartitionedCall", "StatefulPartitionedCall") and depth:
            inner = _called_input(op, tensor)
            where = (inner is not None and _used_at(inner, depth - 1)) or where
        if where:
            return where
    return ""


def _called_input(op, tensor):
    """The input placeholder of the function ``op`` calls that receives ``tensor``."""
    name, graph, function = op.get_attr("f").name, op.graph, None
    while graph is not None and function is None:
        function = getattr(graph, "_functions", {}).get(name)
        graph = getattr(graph, "outer_graph", None)
    inputs = getattr(getattr(function, "graph", None), "inputs", [])
    index = next((i for i, t in enumerate(op.inputs) if t.name == tensor.name), None)
    return inputs[index] if index is not None and index < len(inputs) else None


def _writes(graph, depth=3):
    """(op, the written handle in ``graph``) of each variable write in ``graph`` and in
    the functions it calls (the call op, and its input that the function writes)."""
    out = []
    for op in graph.get_operations():
        if graph_lib.is_write(op):
            out.append((op, op.inputs[0]))
        elif op.type in ("PartitionedCall", "StatefulPartitionedCall") and depth:
            name, outer, function = op.get_attr("f").name, graph, None
            while outer is not None and function is None:
                function = getattr(outer, "_functions", {}).get(name)
                outer = getattr(outer, "outer_graph", None)
            inner = getattr(function, "graph", None)
            if inner is None:
                continue
            index = {t.name: i for i, t in enumerate(inner.inputs)}
            for _, handle in _writes(inner, depth - 1):
                i = index.get(graph_lib.source_op(handle).outputs[0].name)
                if i is not None and i < len(op.inputs):
                    out.append((op, op.inputs[i]))
    return out


def written_variables(body):
    """The variables the loop body writes: the op that holds each one's handle in the graph
    around the loop (what ``lint.check_captures`` walks) -> the writing op's name. The body
    captures a variable's handle from the graph around it, or straight from eager code
    (the handle of a variable made eagerly): then the graph around it holds its own."""
    around = {outer.ref(): inner for outer, inner in getattr(body.outer_graph, "captures", ())}
    outer_of = {inner.ref(): outer for outer, inner in body.captures}
    written = {}
    for op, handle in _writes(body):
        outer = outer_of.get(graph_lib.source_op(handle).outputs[0].ref())
        if outer is not None and not tf.is_symbolic_tensor(outer):
            outer = around.get(outer.ref())
        if outer is not None:
            written[graph_lib.source_op(outer)] = op.name
    return written


def referenced(fn):
    """The objects ``fn`` refers to: its closure, the globals it names, and ``self`` of a
    bound method with that object's attributes (a Keras model's ``optimizer`` and its
    own); a ``tf.function``'s, those of the Python function it wraps."""
    owner = getattr(fn, "__self__", None)
    fn = getattr(fn, "python_function", fn)  # (a tf.function: the function it traces)
    owner = getattr(fn, "__self__", owner)
    code = getattr(fn, "__code__", None)
    found = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()
             if _has_cell_contents(c)]
    if code is not None:
        scope = getattr(fn, "__globals__", {})
        found += [scope[n] for n in code.co_names if n in scope]
    if owner is not None:
        found += [owner, getattr(owner, "optimizer", None)]
        found += [v for v in getattr(owner, "__dict__", {}).values() if is_optimizer(v)]
    return found


def is_optimizer(value):
    return hasattr(getattr(value, "iterations", None), "assign_add")


def held_constants(roots, depth=4):
    """The ids of the eager tensors that an optimizer, a learning-rate schedule, a layer or
    a ``tf.Module`` among ``roots`` (or that the functions among them refer to) holds as an
    attribute, theirs in turn: values they were built with (a Transformer schedule's
    ``tf.cast(d_model, tf.float32)``), constants of every step by design, not values
    computed from the weights before the loop."""
    import keras  # (Keras 3: the objects a TF2 step holds)

    kinds = (keras.optimizers.Optimizer, keras.optimizers.schedules.LearningRateSchedule,
             keras.layers.Layer, tf.Module)

    def functions(value):  # a function the step calls: what it refers to is the step's
        return inspect.isfunction(value) or inspect.ismethod(value)

    roots = [r for r in roots if isinstance(r, kinds) or functions(r)]
    held, seen, todo = set(), set(), [(r, 0) for r in roots]
    while todo:
        obj, level = todo.pop()
        if id(obj) in seen or level > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, kinds):
            values = list(vars(obj).values())
        elif functions(obj):
            values = referenced(obj)
        else:
            values = list(obj.values()) if isinstance(obj, dict) else list(obj)
        for value in values:
            if isinstance(value, tf.Tensor) and not tf.is_symbolic_tensor(value):
                if not functions(obj):  # (a tensor a function refers to itself may be a trap)
                    held.add(id(value))
            elif isinstance(value, (*kinds, list, tuple, dict)) or functions(value):
                todo.append((value, level + 1))
    return held


def _has_cell_contents(cell):
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def random_ops(graph):
    """The stateful random ops (``tf.random.normal``, ``tf.nn.dropout``, ...) of ``graph``
    and of the functions it calls, as ``'name' (Type)`` strings, sorted."""
    found = set()
    for node in graph_lib.program_nodes(graph):
        op_def = op_def_registry.get(node.op)
        if node.op in graph_lib.STATEFUL_RANDOM_OPS or (  # noqa: SLF001 (the shared list)
                op_def is not None and op_def.is_stateful
                and {"seed", "seed2"} <= {a.name for a in op_def.attr}):
            found.add(f"'{node.name}' ({node.op})")
    return sorted(found)


def random_under_xla_message(found):
    return (f"ms.tf2.fuse: jit_compile=True over a step with stateful random ops "
            f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): XLA draws their "
            f"numbers from a generator of its own for each compiled program, seeded or not, "
            f"so the fused steps draw other numbers than N single jit_compile=True calls, "
            f"from step 1. For the same numbers, fuse without jit_compile, or draw with "
            f"stateless ops seeded from a variable the step advances (a Keras layer's "
            f"keras.random.SeedGenerator, as keras.layers.Dropout(rate, seed=...) does, or "
            f"tf.random.stateless_normal(shape, seed=...)).")
