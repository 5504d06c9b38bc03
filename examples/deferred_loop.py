"""A training loop as written, its steps fused by one changed line: ms.deferred.

The loop feeds a batch a call, sums its loss in Python, evaluates every epoch and saves a
checkpoint every other epoch. It runs twice: as written, and with its session deferred
(N = 8); the script checks that every value it printed and the final weights are bitwise
the same, and prints how many compiled runs made the steps.
"""

import os
import tempfile

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
V1.disable_eager_execution()
rng = np.random.RandomState(0)
X = rng.randn(24, 16, 4).astype(np.float32)
Y = (X.sum(-1) > 0).astype(np.int32)


def train(defer):
    graph = tf.Graph()
    with graph.as_default():
        V1.set_random_seed(0)
        x = V1.placeholder(tf.float32, [None, 4])
        y = V1.placeholder(tf.int32, [None])
        hidden = tf.nn.relu(tf.matmul(x, V1.get_variable("w1", [4, 16])))
        logits = tf.matmul(hidden, V1.get_variable("w2", [16, 2]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        train_op = V1.train.AdamOptimizer(0.01).minimize(loss)
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32),
                                                   y), tf.float32))
        saver = V1.train.Saver()
        init = V1.global_variables_initializer()
    sess = V1.Session(graph=graph)
    if defer:
        sess = ms.deferred(sess, steps=8)  # the one changed line
    sess.run(init)
    printed, folder = [], tempfile.mkdtemp()
    for epoch in range(4):
        total = 0.0
        for i in range(len(X)):
            _, value = sess.run([train_op, loss], {x: X[i], y: Y[i]})
            total += value / len(X)
        printed.append(f"epoch {epoch}: loss {total!r}, "
                       f"accuracy {sess.run(accuracy, {x: X[0], y: Y[0]})!r}")
        if epoch % 2 == 1:
            saver.save(sess, os.path.join(folder, "model"), global_step=epoch)
    with graph.as_default():
        weights = sess.run(V1.trainable_variables())
    report = sess.report() if defer else None
    sess.close()
    return printed, weights, report


written, written_weights, _ = train(defer=False)
deferred, deferred_weights, report = train(defer=True)
print("\n".join(deferred))
print(report)
same = written == deferred and all(a.tobytes() == b.tobytes()
                                   for a, b in zip(written_weights, deferred_weights))
print("as written and deferred: " + ("bitwise equal" if same else "DIFFERENT"))
raise SystemExit(0 if same else 1)
