"""Three TF1 training programs as their authors wrote them, fused with ``ms.compile``.

Each program is written once, the ordinary TF1 way (placeholders, ``minimize``, one
``sess.run`` per step), and run twice from the same initial values: with its own
training loop, and with two changed lines:

    fused = ms.compile([loss, train], steps=N)        # after the program is built
    fused.run(sess, {x: X[k:k + N], y: Y[k:k + N]})  # in the loop: N steps a call

The programs: a full-batch dense layer with Adam and a global step (the same batch
every step: fed without the leading N), an MLP with stateful ``tf.nn.dropout``, and
word2vec with ``tf.nn.nce_loss`` and TensorFlow's own candidate sampler. Every
variable (weights, Adam's slots, the global step) must end bitwise equal.

    python examples/as_written.py
"""

import sys

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
N, RUNS = 5, 3
rng = np.random.RandomState(0)


def dense_adam():
    """A dense layer on a full batch, Adam, a global step."""
    x = V1.placeholder(tf.float32, [None, 2], name="x")
    y = V1.placeholder(tf.int32, [None], name="y")
    w = V1.get_variable("w", initializer=np.ones([2, 2], np.float32))
    b = V1.get_variable("b", initializer=np.zeros([2], np.float32))
    logits = tf.matmul(x, w) + b
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    step = V1.train.get_or_create_global_step()
    train = V1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
    data = {x: rng.randn(50, 2).astype(np.float32), y: rng.randint(0, 2, 50).astype(np.int32)}
    return loss, train, lambda k: data  # the same batch at every step


def dropout_mlp():
    """An MLP with tf.nn.dropout (stateful: the loop draws the single steps' stream)."""
    V1.set_random_seed(0)
    x = V1.placeholder(tf.float32, [None, 10], name="x")
    y = V1.placeholder(tf.int32, [None], name="y")
    hidden = tf.nn.relu(tf.matmul(x, V1.get_variable("w1", initializer=np.full([10, 32], 0.1, np.float32))))
    hidden = tf.nn.dropout(hidden, rate=0.5)
    logits = tf.matmul(hidden, V1.get_variable("w2", initializer=np.full([32, 3], -0.1, np.float32)))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    train = V1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
    xs = rng.randn(N * RUNS, 16, 10).astype(np.float32)
    ys = rng.randint(0, 3, (N * RUNS, 16)).astype(np.int32)
    return loss, train, lambda k: {x: xs[k], y: ys[k]}


def word2vec():
    """Skip-gram with tf.nn.nce_loss and its own LogUniformCandidateSampler."""
    V1.set_random_seed(0)
    words = V1.placeholder(tf.int32, [None], name="words")
    context = V1.placeholder(tf.int64, [None, 1], name="context")
    embeddings = V1.get_variable("embeddings", initializer=rng.uniform(-1, 1, [100, 16]).astype(np.float32))
    loss = tf.reduce_mean(tf.nn.nce_loss(
        weights=V1.get_variable("nce_w", initializer=np.zeros([100, 16], np.float32)),
        biases=V1.get_variable("nce_b", initializer=np.zeros([100], np.float32)),
        labels=context, inputs=tf.nn.embedding_lookup(embeddings, words),
        num_sampled=8, num_classes=100))
    train = V1.train.GradientDescentOptimizer(1.0).minimize(loss)
    ids = rng.randint(0, 100, (N * RUNS, 32))
    return loss, train, lambda k: {words: ids[k], context: ids[-1 - k][:, None].astype(np.int64)}


def single_steps(program):
    """The program's own loop: one sess.run per step."""
    rng.seed(0)
    with tf.Graph().as_default():
        loss, train, feed = program()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            losses = [sess.run([loss, train], feed(k))[0] for k in range(N * RUNS)]
            return np.array(losses), {v.op.name: sess.run(v) for v in V1.global_variables()}


def fused_steps(program):
    """The same program with two changed lines: ms.compile, then N steps a call."""
    rng.seed(0)
    with tf.Graph().as_default():
        loss, train, feed = program()
        fused = ms.compile([loss, train], steps=N)                     # changed line 1
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            losses = []
            for k in range(0, N * RUNS, N):
                batches = [feed(j) for j in range(k, k + N)]
                stacked = ({p: np.stack([b[p] for b in batches]) for p in batches[0]}
                           if batches[0] is not batches[1] else batches[0])
                losses.extend(fused.run(sess, stacked)[0])              # changed line 2
            return np.array(losses), {v.op.name: sess.run(v) for v in V1.global_variables()
                                      if not v.op.name.startswith("multistep/")}


if __name__ == "__main__":
    failed = False
    for program in (dense_adam, dropout_mlp, word2vec):
        (want_losses, want), (got_losses, got) = single_steps(program), fused_steps(program)
        same = (sorted(got) == sorted(want) and got_losses.tobytes() == want_losses.tobytes()
                and all(got[n].tobytes() == want[n].tobytes() for n in want))
        failed |= not same
        print(f"{program.__name__}: {N * RUNS} steps in {RUNS} runs of {N}, {len(want)} "
              f"variables: {'bitwise equal' if same else 'DIFFERENT'}")
    print("all three programs: bitwise equal" if not failed else "a program differs")
    sys.exit(1 if failed else 0)
