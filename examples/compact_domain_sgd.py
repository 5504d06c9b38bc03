"""Gradient descent on a circle: w := (w - lr*g + eps) mod 2*pi, with a learning-rate schedule.

The weights are angles. ``ms.rules.compact_sgd`` keeps them in [0, 2*pi) after
every step, adds stateless noise keyed on the global step, and the learning
rate decays at every inner step of a 5-step run. ``ms.verify`` then confirms
that 5-step runs equal single steps bit for bit, noise included.

    python examples/compact_domain_sgd.py
"""

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
TWO_PI = 2 * np.pi
TARGET = np.array([0.5, 3.0, 6.0], np.float32)  # angles to reach


def build(steps):
    gs = V1.train.get_or_create_global_step()
    rule = ms.rules.compact_sgd(TWO_PI, noise_stddev=0.01, seed=1)
    optimizer = ms.RuleOptimizer(
        rule, learning_rate=lambda: V1.train.exponential_decay(0.5, gs, 10, 0.5))

    def loss_fn():
        angles = V1.get_variable("angles", initializer=np.array([5.5, 0.5, 1.0], np.float32))
        return tf.reduce_sum(1.0 - tf.cos(angles - TARGET))

    return ms.unroll(loss_fn, optimizer, steps, global_step=gs), {}


if __name__ == "__main__":
    with tf.Graph().as_default():
        fused, _ = build(5)
        [angles] = fused.var_list  # the variable loss_fn created
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for run in range(6):
                _, losses = sess.run([fused.train_op, fused.losses])
                print(f"run {run + 1}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                      f"angles {np.array2string(sess.run(angles), precision=3)}")
            final = sess.run(angles)
    assert final.min() >= 0.0 and final.max() < TWO_PI
    print(f"target {TARGET}; all angles in [0, 2*pi)")
    print(ms.verify(build, steps=5, runs=6).summary())
