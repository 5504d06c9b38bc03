"""XLA on the CPU, as the compiler uses it: whether a step can compile (every op has an
XLA kernel), and the warning that XLA's random kernels draw other numbers than
TensorFlow's."""

import warnings

import tensorflow as tf
from tensorflow.python.framework import kernels as kernel_registry

from multistep.graph import program_nodes, user_stacklevel

__all__ = ["uncompilable", "warn_random_under_xla"]

# Ops XLA handles itself rather than through a registered kernel (function structure).
_STRUCTURE = frozenset({"NoOp", "Placeholder", "_Arg", "_Retval", "Identity", "IdentityN",
                        "PartitionedCall", "StatefulPartitionedCall", "While", "StatelessWhile",
                        "If", "StatelessIf", "Const"})
_registered = []  # XLA's CPU kernels are registered with the first compilation: once here


def uncompilable(graph):
    """Why ``graph`` (a traced step, its nested functions included) cannot compile under
    XLA on the CPU, or None."""
    _register_xla_kernels()
    nodes = program_nodes(graph)
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
