"""Which kernels each inner step executed: the partition graphs, after Grappler.

Two computations round alike only if they run the same kernels. Grappler and oneDNN
rewrite a graph before it runs (the remapper fuses ``MatMul + BiasAdd + Tanh`` into one
``_FusedMatMul`` or ``_MklNativeFusedMatMul``, the arithmetic optimizer regroups sums,
constant folding merges constants), and whether a rewrite fires depends on the graph's
shape: a control input on the ``MatMul`` is enough to stop the fusion. Which kernels a
rewrite picks also depends on the CPU, so equal bits on one machine prove less than
equal kernels: this module reads the kernels that actually ran
(``RunOptions(output_partition_graphs=True)``) and compares those of each inner step
with a single step's, by name within the step.

Names: step ``k`` of an unrolled build is everything under ``<name>/step_k/`` (its
``forward``, ``gradients``, ``transform``, ``record``, ``check``, ``apply`` and
``after_apply`` scopes); loop mode's steps are the loop body's ops under the same
scopes (``<name>/loop/body/.../step/``). A name within its step (``forward/MatMul``) is
the same in every step and in a single step built by ``ms.unroll(..., steps=1)``.
"""

import collections
import dataclasses
import re

import tensorflow as tf

__all__ = ["Kernel", "LOOP", "by_name", "compare", "count", "executed", "of_copies", "of_steps"]

LOOP = "1..N"  # the key of loop mode's body (every step) in of_steps and of_copies
# A per-step input's slice in a copy, ``<placeholder's name>/_step_input``: what a single
# step is fed, so not one of its kernels.
STEP_INPUT = "_step_input"
_SCOPES = ("forward", "gradients", "transform", "record", "check", "apply", "after_apply")
# Kernels that compute nothing a rounding could change: constants, data movement, control
# flow frames, variables, their handles and reads, feeds, sends and receives between devices.
_PLUMBING = frozenset({
    "Const", "HostConst", "NoOp", "Identity", "IdentityN", "Snapshot", "StopGradient",
    "_Send", "_Recv", "_HostSend", "_HostRecv", "_Arg", "_Retval", "_DeviceArg",
    "_DeviceRetval", "Enter", "RefEnter", "Exit", "RefExit", "Merge", "RefMerge", "Switch",
    "RefSwitch", "_SwitchN", "NextIteration", "RefNextIteration", "LoopCond",
    "ControlTrigger", "Placeholder", "PlaceholderWithDefault", "VarHandleOp", "VariableV2",
    "Variable", "ReadVariableOp", "_ReadVariablesOp"})


@dataclasses.dataclass(frozen=True, order=True)
class Kernel:
    """One executed kernel: its op type and, for a fused kernel, the ops it fused."""

    op: str
    fused: tuple = ()

    def __str__(self):
        return f"{self.op}({', '.join(self.fused)})" if self.fused else self.op


def executed(session, fetches, feed_dict=None):
    """Runs ``fetches`` once; returns (their values, the NodeDefs of every partition
    graph that ran: the kernels after Grappler and oneDNN's rewrites)."""
    metadata = tf.compat.v1.RunMetadata()
    values = session.run(fetches, feed_dict,
                         options=tf.compat.v1.RunOptions(output_partition_graphs=True),
                         run_metadata=metadata)
    return values, [node for graph in metadata.partition_graphs for node in graph.node]


def _kernel(node):
    fused = tuple(s.decode() for s in node.attr["fused_ops"].list.s) if "fused_ops" in node.attr else ()
    return Kernel(node.op, fused)


def of_steps(nodes, name="multistep"):
    """The computing kernels of each inner step of the build named ``name``:
    ``{step: {name within the step: Kernel}}``, steps 1, 2, ... (loop mode: ``LOOP``),
    in the order the partition graphs list them."""
    label = re.escape(name)
    pattern = re.compile(rf"(?:^|/){label}/(?:step_(\d+)|loop/body(?:/_\d+)?/step)/"
                         rf"((?:{'|'.join(_SCOPES)})/.*)$")
    steps = collections.defaultdict(dict)
    for node in nodes:
        if node.op in _PLUMBING:
            continue
        match = pattern.search(node.name)
        if match is None:
            continue
        step = int(match.group(1)) if match.group(1) else LOOP
        # tf.gradients names a gradient after its op's full name: strip the step there too.
        within = re.sub(rf"{label}/(?:step_\d+|loop/body)/", "", match.group(2))
        # A lowered cond's or call's body is inlined as ``cond/then/_57/...``: the number
        # counts the functions inlined so far in the graph, not a place in the step.
        within = re.sub(r"/_\d+/", "/_/", within)
        steps[step][within] = _kernel(node)
    return dict(steps)


def of_copies(nodes, name="multistep"):
    """The computing kernels of each copy of a step that ``ms.compile`` named ``name``
    made: ``{step: {original name: Kernel}}``, steps 1, 2, ... (``name/step_k/``), or
    ``LOOP`` for loop mode's body (``name/loop/body/.../step/``)."""
    pattern = re.compile(rf"^{re.escape(name)}/(?:step_(\d+)|loop/body(?:/_\d+)?/step)/(.*)$")
    steps = collections.defaultdict(dict)
    for node in nodes:
        match = pattern.match(node.name)
        if (match is not None and node.op not in _PLUMBING
                and not node.name.endswith("/" + STEP_INPUT)):
            step = int(match.group(1)) if match.group(1) else LOOP
            steps[step][_within(match.group(2))] = _kernel(node)
    return dict(steps)


def by_name(nodes):
    """The computing kernels of a graph run as it was built (a single step): ``{name:
    Kernel}``, names as ``of_copies`` gives them within a copy."""
    from multistep.compiler.placement import STATE_OWNERS  # made once, shared by the copies
    from multistep.compiler.tripwires import is_tripwire_name  # ms.compile's, on the original ops
    return {_within(node.name): _kernel(node) for node in nodes
            if node.op not in _PLUMBING and node.op not in STATE_OWNERS
            and not is_tripwire_name(node.name)}


def _within(name):
    # A lowered cond's or call's body is inlined as ``cond/then/_57/...``: the number
    # counts the functions inlined so far in the graph, not a place in the step.
    return re.sub(r"/_\d+/", "/_/", name)


def count(nodes):
    """How often each computing kernel ran: a ``Counter`` of ``Kernel``, for comparing a
    step with a single step built another way (``opt.minimize``), whose names differ."""
    return collections.Counter(_kernel(n) for n in nodes if n.op not in _PLUMBING)


@dataclasses.dataclass(frozen=True)
class Difference:
    """Where step ``step``'s kernels differ from a single step's: the names (within the
    step) and kernels on each side that the other side ran otherwise or not at all."""

    step: object
    fused: tuple  # ((name, Kernel), ...) this step ran, that a single step did not
    single: tuple  # ((name, Kernel), ...) a single step ran, that this step did not

    def __str__(self):
        def ran(pairs):
            return ", ".join(f"{name} as {kernel}" for name, kernel in pairs) or "nothing more"
        step = f"step {self.step}" if self.step != LOOP else "steps 1..N (the loop body)"
        return f"{step} ran {ran(self.fused)}; a single step ran {ran(self.single)}"


def compare(steps, single):
    """The first difference between each step's kernels (``of_steps`` of the fused build)
    and ``single`` (``of_steps(...)[1]`` of a single step), or None when every step ran
    the same kernels under the same names. Steps in order, step 1 first.

    Examples:
      The kernels that 3 fused steps ran, step by step, against those of a single step
      built the same way (what ``ms.verify(..., explain=True)`` does); which kernel a
      ``MatMul`` runs as (``MatMul``, ``_MklMatMul``) depends on the CPU:

      >>> import tensorflow as tf, multistep as ms
      >>> def kernels_run(steps):
      ...     with tf.Graph().as_default():
      ...         w = tf.compat.v1.get_variable("w", initializer=[[1.0, 2.0]])
      ...         x = tf.constant([[1.0], [2.0]])
      ...         fused = ms.unroll(lambda: tf.reduce_sum(tf.matmul(x, w)),
      ...                           tf.compat.v1.train.GradientDescentOptimizer(0.1), steps)
      ...         with tf.compat.v1.Session() as sess:
      ...             sess.run(tf.compat.v1.global_variables_initializer())
      ...             _, nodes = ms.kernels.executed(sess, fused.train_op)
      ...     return ms.kernels.of_steps(nodes)
      >>> fused, single = kernels_run(3), kernels_run(1)
      >>> sorted(fused), fused[2]["forward/MatMul"] == single[1]["forward/MatMul"]
      ([1, 2, 3], True)
      >>> print(ms.kernels.compare(fused, single[1]))
      None
    """
    for step in sorted(steps, key=lambda s: (s == LOOP, s if s != LOOP else 0)):
        kernels = steps[step]
        # By name: the partition graphs list a graph's nodes in an order that varies.
        fused = tuple(sorted((n, k) for n, k in kernels.items() if single.get(n) != k))
        alone = tuple(sorted((n, k) for n, k in single.items() if kernels.get(n) != k))
        if fused or alone:
            return Difference(step, fused, alone)
    return None
