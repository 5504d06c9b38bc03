"""Ops that run after each inner step's apply: an EMA of the weights, a max-norm
projection, and seed thread 001's "take the weights mod B after the optimizer step".

A single TF1 step writes them as ``with tf.control_dependencies([train]): ...``;
``ms.unroll(..., after_apply=fn)`` calls ``fn`` once per inner step, after that
step's apply, and runs what it returns before the next step reads anything.

    python examples/ema_and_projection.py
"""

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
rng = np.random.RandomState(0)
X = rng.randn(32, 4).astype(np.float32)
T = (X @ rng.randn(4, 3) * 2).astype(np.float32)


def loss_fn():
    w = V1.get_variable("w", initializer=np.full((4, 3), 0.5, np.float32))
    return tf.reduce_mean(tf.square(X @ w - T))


def ema_and_max_norm(steps):
    """build_fn for ms.verify: Adam, then per step an EMA (decay 0.9) of the weights and a
    projection of each column onto the unit ball."""
    ema = V1.train.ExponentialMovingAverage(0.9)

    def after_apply():
        [w] = V1.trainable_variables()
        project = V1.assign(w, tf.clip_by_norm(w, 1.0, axes=[0]))
        with tf.control_dependencies([project]):  # average the projected weights
            return ema.apply([w])

    return ms.unroll(loss_fn, V1.train.AdamOptimizer(0.1), steps, after_apply=after_apply), {}


def mod_b(steps, modulus=0.75):
    """build_fn for ms.verify: a stock optimizer's step, then w := w mod B."""
    def after_apply():
        [w] = V1.trainable_variables()
        return V1.assign(w, tf.math.floormod(w, modulus))

    return ms.unroll(loss_fn, V1.train.MomentumOptimizer(0.05, 0.9), steps,
                     after_apply=after_apply), {}


np.set_printoptions(precision=4, suppress=True)
for title, build in [("EMA + max-norm projection after Adam", ema_and_max_norm),
                     ("w mod 0.75 after Momentum (seed 001)", mod_b)]:
    report = ms.verify(build, steps=5, runs=4)
    print(f"{title}:")
    print(f"  {report.summary()}")
    values = report.final_values
    print(f"  w after 20 steps, column norms {np.linalg.norm(values['w'], axis=0)}")
    if "w/ExponentialMovingAverage" in values:
        print(f"  its EMA, column norms          "
              f"{np.linalg.norm(values['w/ExponentialMovingAverage'], axis=0)}")
    else:
        print(f"  range of w: [{values['w'].min():.4f}, {values['w'].max():.4f}]")
