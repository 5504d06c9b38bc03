"""Programs as written, compiled with ``ms.compile``, against their own single
``sess.run`` calls: run by tests/test_compile.py in a subprocess per preamble (the
preamble and TF_USE_LEGACY_KERAS are process-global).

    python tests/compile_cases.py {disable_eager_execution,disable_v2_behavior} CASE...

CASE is PROGRAM:MODE (e.g. mlp_dropout:while_loop). Prints one JSON line per case: the
max |Δ| of every global variable and of every fetched value per step against the
reference, the first difference between the kernels a compiled step executed and those
of the original single step (partition graphs, by name within the step), the reads of
step k >= 2 that do not descend from a write of step k-1 in the executed graph, or the
refusal's message.

The reference is the program itself: the same builder, in a fresh graph, one
``sess.run(fetches, feed)`` per step. Both sides start from the same seeded initial
values (each builder makes its variables from numpy constants).
"""

import json
import sys

import numpy as np
import tensorflow as tf

V1 = tf.compat.v1
STEPS, RUNS, BATCH = 3, 2, 8
_rng = np.random.RandomState(0)
X = _rng.randn(STEPS * RUNS, BATCH, 6).astype(np.float32)
IMAGES = _rng.randn(STEPS * RUNS, BATCH, 5, 5, 2).astype(np.float32)
SEQUENCES = _rng.randn(STEPS * RUNS, BATCH, 4, 3).astype(np.float32)
LABELS = _rng.randint(0, 3, size=(STEPS * RUNS, BATCH)).astype(np.int32)
WORDS = _rng.randint(0, 40, size=(STEPS * RUNS, BATCH)).astype(np.int32)


def _var(name, shape, use_resource=None):
    init = np.random.RandomState(len(name) * 7 + sum(shape)).randn(*shape).astype(np.float32) * 0.5
    return V1.get_variable(name, initializer=init, use_resource=use_resource)


def _xent(logits, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def mlp_dropout():
    """An MLP with ``tf.nn.dropout`` (a stateful random op), Adam and a global step."""
    V1.set_random_seed(1)
    x, y = V1.placeholder(tf.float32, [None, 6], "x"), V1.placeholder(tf.int32, [None], "y")
    h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, _var("w1", [6, 8])), _var("b1", [8])))
    h = tf.nn.dropout(h, rate=0.3, seed=7)
    loss = _xent(tf.matmul(h, _var("w2", [8, 3])), y)
    step = V1.train.get_or_create_global_step()
    train = V1.train.AdamOptimizer(0.05).minimize(loss, global_step=step)
    return {"loss": loss, "train": train}, lambda k: {x: X[k], y: LABELS[k]}


def nce():
    """word2vec: ``tf.nn.nce_loss`` with TensorFlow's own candidate sampler."""
    V1.set_random_seed(2)
    words = V1.placeholder(tf.int32, [BATCH], "words")
    context = V1.placeholder(tf.int32, [BATCH], "context")
    embeddings = _var("embeddings", [40, 8])
    loss = tf.reduce_mean(tf.nn.nce_loss(
        weights=_var("nce_w", [40, 8]), biases=_var("nce_b", [40]),
        labels=tf.cast(context[:, None], tf.int64),
        inputs=tf.nn.embedding_lookup(embeddings, words), num_sampled=5, num_classes=40))
    train = V1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return [loss, train], lambda k: {words: WORDS[k], context: WORDS[-1 - k]}


def rnn():
    """``dynamic_rnn`` over an LSTM cell (a while loop in the step), RMSProp."""
    x = V1.placeholder(tf.float32, [BATCH, 4, 3], "x")
    y = V1.placeholder(tf.int32, [BATCH], "y")
    with V1.variable_scope("rnn", initializer=V1.constant_initializer(0.1)):
        cell = V1.nn.rnn_cell.LSTMCell(5)
        out, _ = V1.nn.dynamic_rnn(cell, x, dtype=tf.float32)
    loss = _xent(tf.matmul(out[:, -1], _var("out", [5, 3])), y)
    train = V1.train.RMSPropOptimizer(0.05).minimize(loss)
    return [loss, train], lambda k: {x: SEQUENCES[k], y: LABELS[k]}


def batch_norm():
    """``tf.compat.v1.layers.batch_normalization`` on a fed ``training`` placeholder, its
    moving statistics in UPDATE_OPS under the train op (the canonical single step); the
    flag is fed one value for every step."""
    x = V1.placeholder(tf.float32, [BATCH, 5, 5, 2], "x")
    y = V1.placeholder(tf.int32, [BATCH], "y")
    training = V1.placeholder(tf.bool, [], "training")
    h = tf.nn.conv2d(x, _var("k", [3, 3, 2, 4]), 1, "SAME")
    h = tf.nn.relu(V1.layers.batch_normalization(h, training=training, name="bn"))
    loss = _xent(tf.matmul(tf.reshape(h, [BATCH, 100]), _var("out", [100, 3])), y)
    with tf.control_dependencies(V1.get_collection(V1.GraphKeys.UPDATE_OPS)):
        train = V1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
    return [loss, train], lambda k: {x: IMAGES[k], y: LABELS[k], training: True}


def dataset():
    """A ``tf.data`` iterator read in the step: each step takes the next batch."""
    data = tf.data.Dataset.from_tensor_slices((X, LABELS))
    x, y = V1.data.make_one_shot_iterator(data).get_next()
    loss = _xent(tf.matmul(tf.tanh(tf.matmul(x, _var("w1", [6, 8]))), _var("w2", [8, 3])), y)
    train = V1.train.AdamOptimizer(0.05).minimize(loss)
    return [loss, train], lambda k: {}


def gan():
    """A GAN's two train ops fetched together, the generator's after the
    discriminator's (resource variables)."""
    z = V1.placeholder(tf.float32, [BATCH, 6], "z")
    real = V1.placeholder(tf.float32, [BATCH, 6], "real")
    fake = tf.tanh(tf.matmul(z, _var("g_w", [6, 6], True)))
    d_w = _var("d_w", [6, 1], True)

    def discriminate(h):
        return tf.matmul(tf.nn.leaky_relu(h), d_w)

    ones, zeros = tf.ones([BATCH, 1]), tf.zeros([BATCH, 1])
    xent = tf.nn.sigmoid_cross_entropy_with_logits
    d_loss = tf.reduce_mean(xent(labels=ones, logits=discriminate(real))
                            + xent(labels=zeros, logits=discriminate(fake)))
    d_train = V1.train.AdamOptimizer(0.01, name="d_adam").minimize(d_loss, var_list=[d_w])
    with tf.control_dependencies([d_train]):
        g_loss = tf.reduce_mean(xent(labels=ones, logits=discriminate(fake)))
        g_train = V1.train.AdamOptimizer(0.01, name="g_adam").minimize(
            g_loss, var_list=[V1.trainable_variables("g_w")[0]])
    return ({"d_loss": d_loss, "g_loss": g_loss, "trains": [d_train, g_train]},
            lambda k: {z: X[k], real: X[-1 - k] * 0.5 + 1.0})


def summaries():
    """An MLP with a scalar and a histogram summary merged and fetched beside the train
    op, as a SummarySaverHook fetches them, and a global step."""
    x, y = V1.placeholder(tf.float32, [None, 6], "x"), V1.placeholder(tf.int32, [None], "y")
    h = tf.tanh(tf.matmul(x, _var("w1", [6, 8])))
    loss = _xent(tf.matmul(h, _var("w2", [8, 3])), y)
    V1.summary.scalar("loss", loss)
    # Of an activation: a histogram of a weight fetched beside the train op reads it before
    # or after the apply, as the executor happens to schedule them, in the original too.
    V1.summary.histogram("hidden", h)
    train = V1.train.GradientDescentOptimizer(0.1).minimize(
        loss, global_step=V1.train.get_or_create_global_step())
    return ({"loss": loss, "summary": V1.summary.merge_all(), "train": train},
            lambda k: {x: X[k], y: LABELS[k]})


PROGRAMS = {f.__name__: f for f in (mlp_dropout, nce, rnn, batch_norm, dataset, gan, summaries)}


def _variables(sess):
    return {v.op.name: sess.run(v) for v in V1.global_variables()
            if not v.op.name.startswith("multistep/")}


def reference(program):
    """STEPS * RUNS single steps: (variables after every STEPS of them, per-step values,
    the kernels of the first step by name)."""
    from multistep.compiler import kernels
    with tf.Graph().as_default():
        fetches, feed = program()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            snapshots, values, single = [], [], None
            for k in range(STEPS * RUNS):
                if single is None:
                    value, nodes = kernels.executed(sess, fetches, feed(k))
                    single = kernels.by_name(nodes)
                else:
                    value = sess.run(fetches, feed(k))
                values.append(value)
                if (k + 1) % STEPS == 0:
                    snapshots.append(_variables(sess))
    return snapshots, values, single


def compiled(program, mode):
    """RUNS compiled runs of STEPS steps, each fed its STEPS batches."""
    import multistep as ms
    from multistep.compiler import kernels
    with tf.Graph().as_default():
        fetches, feed = program()
        fused = ms.compile(fetches, steps=STEPS, mode=mode)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            snapshots, values, copies, unordered = [], [], None, None
            for r in range(RUNS):
                feeds = [feed(k) for k in range(r * STEPS, (r + 1) * STEPS)]
                stacked = {key: np.stack([f[key] for f in feeds]) for key in feeds[0]}
                if isinstance(next(iter(stacked.values()), None), np.ndarray) and any(
                        np.ndim(feeds[0][key]) == 0 for key in feeds[0]):
                    stacked.update({key: feeds[0][key] for key in feeds[0]
                                    if np.ndim(feeds[0][key]) == 0})  # one value, every step
                if copies is None:
                    value, nodes = kernels.executed(sess, fused.values, fused.feed_dict(stacked))
                    copies = kernels.of_copies(nodes, fused.name)
                    unordered = unordered_reads(nodes, fused.name)
                else:
                    value = fused.run(sess, stacked)
                values.extend(_per_step(value, STEPS))
                snapshots.append(_variables(sess))
    return snapshots, values, copies, unordered


def _per_step(value, n):
    """The compiled run's values (each [n, ...], train ops None) as n single steps'."""
    return [tf.nest.map_structure(lambda v: None if v is None else v[k], value) for k in range(n)]


# Every write op of a copy counts (ms.unroll's check looks only in its apply scope).
_WRITES = ("ResourceApply", "Apply", "Assign", "ResourceScatter", "ScatterAdd", "ScatterSub",
           "ResourceSparseApply", "SparseApply")


def unordered_reads(nodes, name):
    """The reads of each copy k >= 2 that do not descend from a write of copy k-1 in the
    executed graph (``preamble_cases.unordered_reads``, over every write of a copy)."""
    from preamble_cases import unordered_reads as reads
    return reads(nodes, name, writes=_WRITES, apply_scope=False)


def _delta(a, b):
    if a is None and b is None:
        return 0.0
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "SUO":  # serialized summaries: equal bytes or not
        return 0.0 if a.tobytes() == b.tobytes() else float("inf")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0


def _streams_apart(copies, single):
    """The kernels of each shared random stream (``<op>_stream/``: a stateless op on the
    session's counter, the same Philox draws) stand for the random op they replace in
    the program as written, whose own kernel ran there: each pair left out of the
    comparison, one for one. Returns (copies, single, the replaced ops' names)."""
    from multistep.compiler import streams as streams_lib

    names = {name.rpartition("_stream/")[0] for step in copies.values() for name in step
             if "_stream/" in name}
    replaced = sorted(n for n in names if n in single and single[n].op in streams_lib.REPRODUCED)
    assert replaced == sorted(names), (sorted(names), replaced)  # (each stream for one op)
    copies = {step: {n: k for n, k in kernels.items() if "_stream/" not in n}
              for step, kernels in copies.items()}
    return copies, {n: k for n, k in single.items() if n not in replaced}, replaced


def main(preamble, cases):
    from multistep.compiler import kernels
    for case in cases:
        name, mode = case.split(":")
        program = PROGRAMS[name]
        try:
            got, got_values, copies, unordered = compiled(program, mode)
        except ValueError as error:
            print(json.dumps({"case": case, "refused": str(error)}), flush=True)
            continue
        want, want_values, single = reference(program)
        deltas = {}
        for a, b in zip(got, want):
            assert set(a) == set(b), (sorted(a), sorted(b))
            for key in b:
                deltas[key] = max(deltas.get(key, 0.0), _delta(a[key], b[key]))
        for k, (a, b) in enumerate(zip(got_values, want_values)):
            for path, x, y in zip(range(10 ** 6), tf.nest.flatten(a), tf.nest.flatten(b)):
                deltas[f"value {path}"] = max(deltas.get(f"value {path}", 0.0), _delta(x, y))
        copies, single, streams = _streams_apart(copies, single)
        difference = kernels.compare(copies, single)
        print(json.dumps({
            "streams": streams,
            "case": case, "max_delta": max(deltas.values()), "deltas": deltas,
            "steps": sorted(map(str, copies)), "kernels": len(single),
            "kernel_difference": None if difference is None else str(difference),
            "unordered_reads": unordered}), flush=True)


if __name__ == "__main__":  # (pytest imports this file for its doctests: no switch then)
    getattr(tf.compat.v1, sys.argv[1])()
    main(sys.argv[1], sys.argv[2:])
