"""Check your own model: a two-layer network built with get_variable, verified with ms.verify.

``build(steps)`` builds the model in the current graph and returns
``(unrolled, feed)``; ``feed(run)`` gives fused run ``run`` its ``steps``
minibatches, one per inner step. ``ms.verify`` builds it for ``steps`` and for
1 step, starts both from the same values, and compares every variable (weights,
Adam's slots, the global step) and every step's loss after each run.

    python examples/verify_my_model.py
    multistep verify examples/verify_my_model.py:build --steps 3 --runs 4
"""

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
BATCH, FEATURES, HIDDEN, CLASSES = 16, 4, 8, 3
rng = np.random.RandomState(0)
DATA_X = rng.randn(64, BATCH, FEATURES).astype(np.float32)  # 64 minibatches
DATA_Y = rng.randint(0, CLASSES, size=(64, BATCH)).astype(np.int32)


def loss_fn(x, y):
    def dense(inputs, units, name):
        with V1.variable_scope(name):
            w = V1.get_variable("w", [inputs.shape[-1], units],
                                initializer=V1.glorot_uniform_initializer())
            b = V1.get_variable("b", [units], initializer=V1.zeros_initializer())
        return tf.matmul(inputs, w) + b

    logits = dense(tf.nn.relu(dense(x, HIDDEN, "hidden")), CLASSES, "logits")
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def build(steps):
    xs = V1.placeholder(tf.float32, [steps, BATCH, FEATURES], name="xs")
    ys = V1.placeholder(tf.int32, [steps, BATCH], name="ys")
    unrolled = ms.unroll(loss_fn, V1.train.AdamOptimizer(0.01), steps, inputs=(xs, ys),
                         global_step=V1.train.get_or_create_global_step())

    def feed(run):
        batches = np.arange(run * steps, (run + 1) * steps) % 64  # (round the 64 again)
        return {xs: DATA_X[batches], ys: DATA_Y[batches]}

    return unrolled, feed


if __name__ == "__main__":
    report = ms.verify(build, steps=3, runs=4)
    print(report)
    raise SystemExit(0 if report.ok else 1)
