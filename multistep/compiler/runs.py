"""Running a compiled program: one callable per session, what a run returns (a fetch
whose shape differs between steps as one array a step), and the errors of a run that
stops midway (how many steps it applied, and their values where the program keeps them).
Shared by ``ms.compile``'s ``Compiled`` and ``ms.unroll``'s ``Unrolled``."""

import re

import numpy as np
import tensorflow as tf

__all__ = ["InputExhaustedError", "PLAIN_SESSIONS", "StepFailedError", "callable_for",
           "exhausted_message", "failed_message", "per_step_values"]


class InputExhaustedError(tf.errors.OutOfRangeError):
    """A ``tf.data`` input ran out in the middle of a fused run.

    ``values``: the values of the steps the run applied before, as ``run`` returns a
    run's (``[k, ...]`` for k steps applied; None for a fetch whose values are not kept),
    where the program keeps them (``ms.compile``'s loop mode); else None."""

    def __init__(self, message, error, values=None):
        super().__init__(error.node_def, error.op, message)
        self.values = values


class StepFailedError(tf.errors.InvalidArgumentError):
    """A check in the step (``tf.debugging.Assert``, ``check_numerics``) failed at some
    step of a compiled run: the steps before it stay applied. The message is
    TensorFlow's, then how many steps were applied; ``values`` as
    ``InputExhaustedError``'s."""

    def __init__(self, message, error, values=None):
        super().__init__(error.node_def, error.op, message)
        self.values = values


def failed_message(program, session, error, values):
    """``StepFailedError``'s message: TensorFlow's, then the steps the run applied."""
    applied, length = session.run([program._run_length.done, program._run_length.read])
    also = ""
    if program._started is not None and program.global_step is not None:  # noqa: SLF001
        now, started = session.run([program.global_step, program._started])  # noqa: SLF001
        if now - started != applied * (program.step_increment or 1):
            also = (f"; and step {applied + 1}'s own updates ran, which its failing check "
                    f"does not guard (nor does it in a single step): the global step moved "
                    f"by {now - started} in this run, to {now}")
    return (f"{error.message}\n{program.name}: the run failed at its step {applied + 1}: the "
            f"first {applied} of its {length} steps were applied"
            + ("" if values is None else " (their values: this error's .values)") + also + ".")


def exhausted_message(program, session, error):
    """What a run of ``program`` that ran out of input applied: the message of
    ``InputExhaustedError`` (``ms.unroll``'s and ``ms.compile``'s)."""
    # The op that ran out; make_callable's errors name it only in their message.
    failed = getattr(error.op, "name", None) or error.message
    where = re.search(rf"{re.escape(program.name)}/step_(\d+)/", failed)
    length = program.steps if program._run_length is None else session.run(program._run_length.read)
    if where:
        applied = int(where.group(1)) - 1
    elif program._run_length is not None and program._run_length.done is not None:
        applied = session.run(program._run_length.done)  # the loop counts the steps it ended
    else:
        applied = None
    if getattr(program, "_batches_first", False):  # ms.distribute.unroll over an iterator
        done = (f"none of its {length} steps were applied: a run takes its {length} batches "
                f"before its first step, fewer were left, and those it took are lost")
    elif applied is not None:
        done = f"the first {applied} of its {length} steps were applied"
    else:
        done = "the steps before the missing batch were applied"
    if program.global_step is not None:
        done += f"; the global step is now {session.run(program.global_step)}"
    return (f"{program.name}: the input ran out during a run: {done}. Re-initialise or "
            f"repeat the dataset, or make it a multiple of {length} batches long.")


PLAIN_SESSIONS = (tf.compat.v1.Session, tf.compat.v1.InteractiveSession)


def callable_for(callables, session, fetches):
    """(the callable that runs ``fetches`` on ``session``, made now?): one
    ``Session.make_callable`` per session, kept in ``callables`` (a WeakKeyDictionary)."""
    if session in callables:
        return callables[session], False
    # A callable holds its session, so its weak key would never die: drop the callables of
    # closed sessions, which then free their resources.
    for closed in [s for s in callables if s._closed]:
        del callables[closed]
    callables[session] = session.make_callable(fetches)
    return callables[session], True


def per_step_values(value, shape):
    """The numpy values of a ``_ragged`` fetch as ``sess.run`` gave them (a
    ``RaggedTensorValue``): one array a step, of that step's shape (``shape``: the
    fetch's static shape, for the dimensions after an empty one); stacked into one
    ``[N, ...]`` array where every step's shape is the same, as for any other fetch."""
    splits = [np.asarray(s) for s in value.nested_row_splits]
    flat = np.asarray(value.flat_values)
    steps = []
    for k in range(len(splits[0]) - 1):
        lo, hi, dims = k, k + 1, []
        for level, split in enumerate(splits):
            dims.append(int(split[lo + 1] - split[lo]) if hi > lo else shape[level] or 0)
            lo, hi = split[lo], split[hi]
        steps.append(flat[lo:hi].reshape(dims))
    if len({a.shape for a in steps}) == 1:
        return np.stack(steps)
    return steps
