"""``ms.tf2.check``: the traps in a training loop's body, found before anything runs."""


import tensorflow as tf

from multistep.tf2.findings import (capture_findings, held_constants, loop_bodies,
                                    python_state_findings, referenced, written_variables)
from multistep.tf2.fuse import Fused, is_iterator

__all__ = ['check']


def check(fused, *args):
    """The traps in a training loop's body, before anything runs (it traces, which creates
    the variables a lazily built model makes): a list of ``Finding``.

    ``fused``: what ``ms.tf2.fuse`` returned, called as ``check(fused, batches)``; or any
    ``tf.function`` whose body has a ``tf.while_loop`` (a hand-written ``for i in
    tf.range(n)`` training loop), called as ``check(fn, *its_arguments)``: every loop in
    it is checked for the first two kinds.

    - ``stale``: the loop uses a value computed before it from a read of a variable the
      loop writes (evaluated once per call, so every step reuses the first value); the
      message names the line that built it.
    - ``frozen``: the loop uses a float value captured from Python or eager code (a
      constant in every step and every call; harmless for data, wrong for anything
      computed from the weights, such as a gradient or an L2 term computed eagerly); the
      message names the line that uses it. A tensor that an optimizer, a learning-rate
      schedule or a layer holds as an attribute (a schedule's ``tf.cast(d_model,
      tf.float32)``) is a constant it was built with, not reported.
    - ``python_state`` (``ms.tf2.fuse`` only): two traces of ``step_fn`` differ in a
      constant: Python state (a counter, a float attribute) that each trace freezes at
      its value then.
    """
    if not isinstance(fused, Fused):
        if not hasattr(fused, "get_concrete_function"):
            raise TypeError(f"check takes what ms.tf2.fuse returned, or a tf.function with a "
                            f"loop; got {type(fused).__name__}.")
        graph = fused.get_concrete_function(*args).graph
        bodies = loop_bodies(graph)
        if not bodies:
            raise ValueError(f"check: {getattr(fused, '__name__', fused)!r} has no "
                             f"tf.while_loop (a `for` over tf.range, traced by AutoGraph) to "
                             f"check; a loop in Python runs once per step of its own.")
        name = f"{getattr(fused, '__name__', 'the function')}'s loop"
        constants = held_constants(referenced(getattr(fused, "python_function", fused)))
        return [f for body in bodies for f in capture_findings(
            body, written_variables(body), name=name, constants=constants)]
    if len(args) != 1:
        raise TypeError("check(fused, batches): the batches, one argument.")
    [batches] = args
    if batches is None:
        raise TypeError("check(fused, batches): batches is None; give the N batches the "
                        "fused call takes (tensors with a leading dimension N).")
    if is_iterator(batches):
        raise TypeError("check takes batches as tensors with a leading dimension N; take N "
                        "elements from the iterator first.")
    fused._check_leading(batches)
    fused._function.get_concrete_function(
        tf.nest.map_structure(tf.convert_to_tensor, batches), tf.constant(fused.steps))
    return fused.findings() + python_state_findings(fused, batches)
