"""Batch normalization's moving statistics, updated once per inner step.

``tf.compat.v1.layers.batch_normalization(training=True)`` adds its moving-mean
and moving-variance updates to ``UPDATE_OPS``; a single step runs them with
``with tf.control_dependencies(UPDATE_OPS): minimize(loss)``. ``ms.unroll``
runs step k's update ops in step k, before its apply (``update_ops=True``, the
default), so the statistics a model is served with match N single steps bit for bit.

The TF1 layers come from tf-keras: ``pip install '.[legacy]'``; this script sets
``TF_USE_LEGACY_KERAS=1`` before TensorFlow is imported.

    python examples/batch_norm.py
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # read once, when TensorFlow is imported

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import multistep as ms  # noqa: E402

V1 = tf.compat.v1
STEPS, RUNS = 4, 3
rng = np.random.RandomState(0)
X = (rng.randn(STEPS * RUNS, 16, 5) * 3 + 1).astype(np.float32)  # one batch per step
Y = rng.randint(0, 2, size=(STEPS * RUNS, 16)).astype(np.int32)
W1, W2 = rng.randn(5, 8).astype(np.float32) * 0.5, rng.randn(8, 2).astype(np.float32) * 0.5


def loss_fn(x, y):
    h = V1.layers.dense(x, 8, name="hidden", kernel_initializer=V1.constant_initializer(W1))
    h = tf.nn.relu(V1.layers.batch_normalization(h, training=True, name="bn"))
    logits = V1.layers.dense(h, 2, name="out", kernel_initializer=V1.constant_initializer(W2))
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def statistics(sess):
    return {name: sess.run(V1.get_collection(V1.GraphKeys.GLOBAL_VARIABLES, name)[0])
            for name in ("bn/moving_mean", "bn/moving_variance")}


def single_steps():
    """The canonical TF1 step, one sess.run each: the statistics after every STEPS steps."""
    with tf.Graph().as_default():
        x, y = V1.placeholder(tf.float32, [16, 5]), V1.placeholder(tf.int32, [16])
        loss = loss_fn(x, y)
        with tf.control_dependencies(V1.get_collection(V1.GraphKeys.UPDATE_OPS)):
            train = V1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            after = []
            for k in range(STEPS * RUNS):
                sess.run(train, {x: X[k], y: Y[k]})
                if (k + 1) % STEPS == 0:
                    after.append(statistics(sess))
            return after, {v.op.name: sess.run(v) for v in V1.global_variables()}


def fused_steps():
    with tf.Graph().as_default():
        xs, ys = V1.placeholder(tf.float32, [STEPS, 16, 5]), V1.placeholder(tf.int32, [STEPS, 16])
        unrolled = ms.unroll(loss_fn, V1.train.MomentumOptimizer(0.1, 0.9), STEPS, inputs=(xs, ys))
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            after = []
            for r in range(RUNS):
                sess.run(unrolled.train_op, {xs: X[r * STEPS:(r + 1) * STEPS],
                                             ys: Y[r * STEPS:(r + 1) * STEPS]})
                after.append(statistics(sess))
            return after, {v.op.name: sess.run(v) for v in V1.global_variables()}


single, single_final = single_steps()
fused, fused_final = fused_steps()
np.set_printoptions(precision=5, suppress=True)
print(f"{RUNS} runs of {STEPS} fused steps beside {STEPS * RUNS} single steps (MomentumOptimizer)")
for r, (f, s) in enumerate(zip(fused, single), start=1):
    for name in f:
        print(f"  after step {r * STEPS:>2}  {name:<19} fused  {f[name][:4]} ...")
        print(f"  {'':>13} {'':<19} single {s[name][:4]} ...")
differ = [n for n in single_final if fused_final[n].tobytes() != single_final[n].tobytes()]
print(f"{len(single_final)} variables compared (weights, slots, moving statistics): "
      + ("all bitwise equal" if not differ else f"DIFFER: {differ}"))
