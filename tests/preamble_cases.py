"""Fused steps against canonical TF1 single steps under one preamble: run by
tests/test_preambles.py in a subprocess (the preamble, TF_ENABLE_ONEDNN_OPTS and
TF_USE_LEGACY_KERAS are process-global: read at import or switched once).

    python tests/preamble_cases.py {disable_eager_execution,disable_v2_behavior} CASE...

CASE is MODEL:KIND:MODE:OPTIMIZER[:short][:skip] (e.g. mlp:ref:while_loop:Adam). Prints one JSON line
per case: the max |Δ| of every global variable and of the per-step losses against the
reference, and the first difference between the kernels an inner step executed and
those of a single step (``ms.unroll(..., steps=1)``), by name within the step, and two
structural readings of the executed graph: reads that may run before the previous
step's apply (``unordered_reads``), and max pool gradients that oneDNN's layout pass may
visit before their pool (``visit_order``).

The reference is written here without multistep, the canonical TF1 way: one
``opt.minimize(loss)`` under ``tf.control_dependencies(UPDATE_OPS)``, one ``sess.run``
per step, each fed its own batch. Both sides start from the same constant initial
values. Kernels: each fused inner step's executed kernels (partition graphs, after
Grappler and oneDNN) against a single step's, so that a rewrite that fires in one and
not the other fails the test even where this CPU rounds both alike.
"""

import json
import re
import sys

import numpy as np
import tensorflow as tf

import multistep as ms  # imports no TensorFlow switch: the preamble below is the user's
from multistep.compiler import kernels

V1 = tf.compat.v1
STEPS, RUNS, BATCH = 3, 2, 8
OPTIMIZERS = {
    "SGD": lambda: V1.train.GradientDescentOptimizer(0.1),
    "Momentum": lambda: V1.train.MomentumOptimizer(0.1, 0.9),
    "Adam": lambda: V1.train.AdamOptimizer(0.05),
    "RMSProp": lambda: V1.train.RMSPropOptimizer(0.05),
}
_rng = np.random.RandomState(0)
FLAT_X = _rng.randn(STEPS * RUNS, BATCH, 6).astype(np.float32)
IMAGE_X = _rng.randn(STEPS * RUNS, BATCH, 5, 5, 2).astype(np.float32)
LABELS = _rng.randint(0, 3, size=(STEPS * RUNS, BATCH)).astype(np.int32)


def _var(name, shape, kind):
    init = np.random.RandomState(len(name) * 7 + sum(shape)).randn(*shape).astype(np.float32) * 0.5
    return V1.get_variable(name, initializer=init, use_resource=kind == "resource")


def _xent(logits, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def mlp(x, y, kind):
    """The issue's ref-variable MLP, then a layer for each activation the remapper fuses
    after MatMul + BiasAdd (oneDNN also fuses MatMul + Add + activation)."""
    h = tf.tanh(tf.matmul(x, _var("w1", [6, 8], kind)) + _var("b1", [8], kind))
    for i, act in enumerate([tf.nn.relu, tf.nn.relu6, tf.nn.elu, tf.sigmoid, tf.nn.leaky_relu]):
        h = act(tf.nn.bias_add(tf.matmul(h, _var(f"w{i + 2}", [8, 8], kind)),
                               _var(f"b{i + 2}", [8], kind)))
    return _xent(tf.matmul(h, _var("out", [8, 3], kind)), y)


def conv(x, y, kind):
    """Conv2D + BiasAdd + Relu (the remapper's _FusedConv2D), a 2x2 max pool (whose
    gradient oneDNN rewrites only after visiting the pool: ``visit_order``), then a dense
    head."""
    h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, _var("k", [3, 3, 2, 4], kind), 1, "SAME"),
                                  _var("kb", [4], kind)))
    h = tf.nn.max_pool2d(h, 2, 2, "SAME")
    return _xent(tf.matmul(tf.reshape(h, [BATCH, 36]), _var("out", [36, 3], kind)), y)


def batch_norm(x, y, kind):
    """Conv2D, then tf.compat.v1.layers.batch_normalization (FusedBatchNormV3, its
    moving statistics in UPDATE_OPS), Relu and a dense head."""
    with V1.variable_scope("bn_model", use_resource=kind == "resource"):
        h = tf.nn.conv2d(x, _var("k", [3, 3, 2, 4], kind), 1, "SAME")
        h = tf.nn.relu(V1.layers.batch_normalization(h, training=True, fused=True, name="bn"))
        return _xent(tf.matmul(tf.reshape(h, [BATCH, 100]), _var("out", [100, 3], kind)), y)


def _training():
    """The graph's fed ``training`` switch (True unless fed), made once per graph."""
    graph = V1.get_default_graph()
    found = graph.get_collection("training_switch")
    if not found:
        with graph.as_default(), graph.name_scope(None):
            found = [V1.placeholder_with_default(True, [], name="training")]
        graph.add_to_collection("training_switch", found[0])
    return found[0]


def bn_placeholder(x, y, kind):
    """Batch norm switched by a fed ``training`` placeholder: its normalisation and its
    moving-statistics updates each in a ``tf.cond`` on it (the issue's race: reads inside
    a cond waited for the placeholder only)."""
    with V1.variable_scope("bnp_model", use_resource=kind == "resource"):
        h = tf.nn.conv2d(x, _var("k", [3, 3, 2, 4], kind), 1, "SAME")
        h = tf.nn.relu(V1.layers.batch_normalization(h, training=_training(), name="bn"))
        return _xent(tf.matmul(tf.reshape(h, [BATCH, 100]), _var("out", [100, 3], kind)), y)


def cond_read(x, y, kind):
    """A dropout-style ``tf.cond`` on the fed placeholder whose true branch reads trained
    weights (a scale computed from ``w2``) and whose input is computed in the step."""
    w1, w2 = _var("w1", [6, 8], kind), _var("w2", [8, 3], kind)
    h = tf.tanh(tf.matmul(x, w1))
    h = tf.cond(_training(), lambda: h * tf.sigmoid(tf.reduce_mean(w2)), lambda: h)
    return _xent(tf.matmul(h, w2), y)


def shared_dense(x, y, kind):
    """One ``tf.compat.v1.layers.Dense`` object, made once per graph (outside the loss
    function), called at three time steps: every call after its first names its ops in
    its first call's name scope."""
    graph = V1.get_default_graph()
    if not graph.get_collection("shared_dense"):  # (no name scope: its variables' scope is its first call's)
        init = V1.constant_initializer(np.random.RandomState(4).randn(6, 6) * 0.4)
        graph.add_to_collection("shared_dense", V1.layers.Dense(
            6, activation=tf.tanh, kernel_initializer=init, name="cell"))
    [cell] = graph.get_collection("shared_dense")
    h = tf.zeros([BATCH, 6])
    for t in range(3):
        with V1.variable_scope("rnn", use_resource=kind == "resource"):
            h = cell(x * float(t + 1) + h)
    return _xent(tf.matmul(h, _var("out", [6, 3], kind)), y)


MODELS = {"mlp": (mlp, FLAT_X), "conv": (conv, IMAGE_X), "batch_norm": (batch_norm, IMAGE_X),
          "bn_placeholder": (bn_placeholder, IMAGE_X), "cond_read": (cond_read, FLAT_X),
          "shared_dense": (shared_dense, FLAT_X)}


def _values(sess):
    return {v.op.name: sess.run(v) for v in V1.global_variables()}


def reference(model, kind, optimizer, lengths):
    """``sum(lengths)`` canonical single steps: (values after each ``lengths[r]`` of
    them, losses)."""
    build, data = MODELS[model]
    ends = np.cumsum(lengths)
    with tf.Graph().as_default():
        x = V1.placeholder(tf.float32, data.shape[1:])
        y = V1.placeholder(tf.int32, [BATCH])
        loss = build(x, y, kind)
        with tf.control_dependencies(V1.get_collection(V1.GraphKeys.UPDATE_OPS)):
            train = OPTIMIZERS[optimizer]().minimize(loss)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            snapshots, losses = [], []
            for i in range(ends[-1]):
                losses.append(sess.run([train, loss], {x: data[i], y: LABELS[i]})[1])
                if i + 1 in ends:
                    snapshots.append(_values(sess))
    return snapshots, np.array(losses, np.float32)


def fused(model, kind, mode, optimizer, steps, lengths, **options):
    """Fused runs of ``lengths[r]`` steps each (loop mode: ``set_steps_per_run`` before a
    run shorter than ``steps``), each fed its own batches: (values after each run,
    losses, the kernels each inner step executed in the first run, by name within the
    step)."""
    build, data = MODELS[model]
    with tf.Graph().as_default():
        x = V1.placeholder(tf.float32, (None,) + data.shape[1:])
        y = V1.placeholder(tf.int32, [None, BATCH])
        unrolled = ms.unroll(lambda xk, yk: build(xk, yk, kind), OPTIMIZERS[optimizer](), steps,
                             inputs=(x, y), mode=mode, **options)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            snapshots, losses, executed, start = [], [], None, 0
            for length in lengths:
                if unrolled.steps_per_run is not None:
                    unrolled.set_steps_per_run(sess, length)
                feed = {x: data[start:start + length], y: LABELS[start:start + length]}
                start += length
                if executed is None:
                    value, nodes = kernels.executed(sess, unrolled.losses, feed)
                    executed = kernels.of_steps(nodes, unrolled.name)
                    unordered = unordered_reads(nodes, unrolled.name)
                    pool_grads = visit_order(nodes, unrolled.name)
                else:
                    value = sess.run(unrolled.losses, feed)
                losses.extend(value)
                snapshots.append(_values(sess))
    return snapshots, np.array(losses, np.float32), executed, unordered, pool_grads


_PASS_THROUGH = frozenset({"Identity", "RefIdentity", "Switch", "RefSwitch", "Enter", "RefEnter"})


_APPLY_WRITES = ("ResourceApply", "Apply", "Assign")


def unordered_reads(nodes, name="multistep", *, writes=_APPLY_WRITES, apply_scope=True):
    """The variable reads of each unrolled inner step k >= 2 that, in the executed
    (lowered, inlined) partition graphs, do not descend from a write of step k-1's apply:
    reads that may run before it, whatever this run's timing. A read: a node of step k
    that takes a variable (a handle or a ref, through identities and v1 control flow's
    switches) as a data input and is not itself a write or a pass-through. A write: a node
    of step k-1 whose op starts with one of ``writes`` (and, with ``apply_scope``, under
    ms.unroll's ``apply`` scope; ms.compile's copies keep the program's own names)."""
    by_name = {n.name: n for n in nodes}
    children = {}
    for n in nodes:
        for i in n.input:
            children.setdefault(i.lstrip("^").split(":")[0], []).append(n.name)

    def source(n):
        while n.op in _PASS_THROUGH and n.input:
            n = by_name.get(n.input[0].split(":")[0], n)
            if n.op not in _PASS_THROUGH:
                break
        return n

    step_of = {}
    for n in nodes:
        found = re.search(rf"(?:^|/){name}/step_(\d+)/", n.name)
        if found:
            step_of[n.name] = int(found.group(1))
    found = []
    for k in sorted(set(step_of.values()) - {1}):
        wrote = [n.name for n in nodes if step_of.get(n.name) == k - 1 and n.op.startswith(writes)
                 and (not apply_scope or "/apply/" in n.name)]
        after, stack = set(), list(wrote)
        while stack:
            current = stack.pop()
            if current not in after:
                after.add(current)
                stack.extend(children.get(current, ()))
        for n in nodes:
            if step_of.get(n.name) != k or n.op in _PASS_THROUGH or n.op.startswith(
                    writes) or n.name in after:
                continue
            if any(source(by_name[i.split(":")[0]]).op in ("VarHandleOp", "VariableV2")
                   for i in n.input if not i.startswith("^") and i.split(":")[0] in by_name):
                found.append(n.name)
    return found


def visit_order(nodes, name="multistep"):
    """(The loop body's MaxPoolGrad nodes, those of them that oneDNN's layout pass may
    visit before their forward MaxPool). The pass rewrites MaxPoolGrad to its oneDNN
    kernel only if it has visited the MaxPool first, in a depth-first reverse post-order
    whose edge order follows hashed pointers: in a loop body, the grad may come first
    unless one node, the copy's ``_gate``, dominates it (every way in from the graph's
    roots passes it) and separates it from its pool's input (every way from the grad
    back to the next step's forward passes it). Read from the executed graph, whatever
    order this process's hashing gave."""
    children = {}
    for n in nodes:
        for i in n.input:
            children.setdefault(i.lstrip("^").split(":")[0], []).append(n.name)
    by_name = {n.name: n for n in nodes}
    gates = {n.name for n in nodes if n.name.endswith("/_gate")}

    def reached(starts):
        seen, stack = set(starts), list(starts)
        while stack:
            for child in children.get(stack.pop(), ()):
                if child not in seen and child not in gates:
                    seen.add(child)
                    stack.append(child)
        return seen

    from_roots = reached([n.name for n in nodes if not n.input])
    grads = [n for n in nodes if n.op.endswith("MaxPoolGrad") and f"{name}/loop/" in n.name]
    unordered = []
    for grad in grads:  # (its input 1: the pool's output; the pool's input 0: what it pools)
        pooled = by_name[grad.input[1].split(":")[0]].input[0].split(":")[0]
        if grad.name in from_roots or pooled in reached([grad.name]):
            unordered.append(grad.name)
    return [g.name for g in grads], unordered


def main(cases):
    for case in cases:
        model, kind, mode, optimizer, *extra = case.split(":")
        # ":short" (loop mode): a run of STEPS steps, then set_steps_per_run(STEPS - 1);
        # ":skip": nonfinite="skip" (each apply in a tf.cond; no step is non-finite here).
        lengths = [STEPS, STEPS - 1] if "short" in extra else [STEPS] * RUNS
        options = {"nonfinite": "skip"} if "skip" in extra else {}
        want, want_losses = reference(model, kind, optimizer, lengths)
        got, got_losses, steps, unordered, pool_grads = fused(
            model, kind, mode, optimizer, STEPS, lengths, **options)
        got = [{n: v for n, v in values.items() if n != "multistep/skipped_steps"} for values in got]
        single = fused(model, kind, mode, optimizer, 1, [1], **options)[2][1]
        deltas = {"losses": float(np.max(np.abs(got_losses - want_losses)))}
        for a, b in zip(got, want):
            assert set(a) == set(b), (sorted(a), sorted(b))
            for name in b:
                diff = float(np.max(np.abs(a[name].astype(np.float64) - b[name])))
                deltas[name] = max(deltas.get(name, 0.0), diff)
        difference = kernels.compare(steps, single)
        print(json.dumps({"case": case, "max_delta": max(deltas.values()), "deltas": deltas,
                          "steps": sorted(map(str, steps)), "kernels": len(single),
                          "ops": sorted({str(k) for k in single.values()}),
                          "kernel_difference": None if difference is None else str(difference),
                          "unordered_reads": unordered, "pool_grads": pool_grads}),
              flush=True)


if __name__ == "__main__":  # (pytest imports this file for its doctests: no switch then)
    if sys.argv[1] == "disable_v2_behavior":
        tf.compat.v1.disable_v2_behavior()
    else:
        tf.compat.v1.disable_eager_execution()
    main(sys.argv[2:])
