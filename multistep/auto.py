"""``mode="auto"``: loop mode under XLA where the step compiles, unrolled mode otherwise.

The choice is made at build time by trying: the step is traced as an XLA program (creating
the variables and slots, as the compiled build would), and every op of it, nested
functions included, must have an XLA kernel for the CPU. Nothing runs. The reasons it
can fail, each reported in ``Unrolled.why``: a ``tf.data`` iterator input (XLA does not
compile ``IteratorGetNext``), a ``tf.distribute`` replica context (a ``merge_call``
cannot run in a compiled program), ref variables, an op without an XLA kernel (a
``py_function``, string ops, ...).
"""

import tensorflow as tf
from tensorflow.python.framework import kernels as kernel_registry

from multistep import lint

__all__ = ["choose", "uncompilable"]

# Ops XLA handles itself rather than through a registered kernel (function structure).
_STRUCTURE = frozenset({"NoOp", "Placeholder", "_Arg", "_Retval", "Identity", "IdentityN",
                        "PartitionedCall", "StatefulPartitionedCall", "While", "StatelessWhile",
                        "If", "StatelessIf", "Const"})
_registered = []  # XLA's CPU kernels are registered with the first compilation: once here


def choose(step, feed, label, *, in_replica_context):
    """(mode, xla, why): ``("while_loop", True, None)`` when the step compiles under XLA,
    else ``("unrolled", False, the reason)``. Tracing the step creates its variables; the build
    that follows reuses them (``step.rebuild``)."""
    if in_replica_context:
        return "unrolled", False, ("in a tf.distribute replica context: each step's apply "
                                   "all-reduces through a merge_call, which cannot run inside "
                                   "a compiled program or a loop body")
    if feed.iterator is not None:
        return "unrolled", False, ("the inputs come from a tf.data iterator, and XLA does not "
                                   "compile IteratorGetNext (batch N steps at once to compile)")
    names = step.names_now()
    step.guard.lift = step.xla = True

    def step_1():
        return step.build(feed.args(0), step.initial_carry)[0]

    try:
        graph = tf.function(step_1, jit_compile=True, autograph=False).get_concrete_function().graph
        why = uncompilable(graph)
    except (TypeError, ValueError):  # what TensorFlow raises over a ref variable
        # The graph's variables: the trace may fail before the step knows its own (var_list
        # is found with the gradients; a ref variable's update op fails in the forward pass).
        ref = [v.op.name for v in tf.compat.v1.global_variables() if v.op.type != "VarHandleOp"]
        if not ref:
            raise
        why = (f"{', '.join(map(repr, ref))} {'is a ref variable' if len(ref) == 1 else 'are ref variables'}"
               f", which XLA cannot compile (use_resource=True makes resource variables)")
    finally:
        step.guard.lift = step.xla = False
        names.write()  # the layer and scope counters as the trace found them, for the build
        step.rebuild = True
    if why is not None:
        return "unrolled", False, why
    return "while_loop", True, None


def uncompilable(graph):
    """Why ``graph`` (a traced step, its nested functions included) cannot compile under
    XLA on the CPU, or None."""
    _register_xla_kernels()
    nodes = lint.program_nodes(graph)
    missing = sorted({n.op for n in nodes if n.op not in _STRUCTURE and not _has_xla_kernel(n.op)})
    if missing:
        where = [n.name for n in nodes if n.op == missing[0]][0]
        return (f"op type {missing[0]!r} (e.g. {where!r}) has no XLA kernel"
                + (f", nor {', '.join(map(repr, missing[1:4]))}" if len(missing) > 1 else ""))
    return None


def _has_xla_kernel(op_type):
    return any(k.device_type == "XLA_CPU_JIT"
               for k in kernel_registry.get_registered_kernels_for_op(op_type).kernel)


def _register_xla_kernels():
    """XLA registers its CPU kernels (device XLA_CPU_JIT) when it first compiles: compile a
    trivial program once, in a graph and session of its own."""
    if _registered:
        return
    with tf.Graph().as_default() as graph:
        one = tf.function(lambda: tf.constant(1.0) + 1.0, jit_compile=True, autograph=False)()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(one)
    _registered.append(True)
