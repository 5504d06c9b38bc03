"""Which gradient does Adam accumulate when you clip? The clipped one, at every inner step.

Each 3-step run (``ms.compile`` of the single step as written) returns, per inner step,
the raw gradient and the gradient after ``ms.clip_by_global_norm(1.0)``, then
prints Adam's first-moment slot m beside two numpy running averages,
m = b1*m + (1-b1)*g: one fed with the clipped gradients, one with the raw ones.
The slot follows the clipped one.

    python examples/clipped_adam.py
"""

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
rng = np.random.RandomState(0)
x = rng.randn(32, 2).astype(np.float32)
y = (x @ np.array([4.0, -3.0], np.float32) + 10.0).astype(np.float32)  # far from w = 0: big gradients


with tf.Graph().as_default():
    # The single step as written: gradients, the clip (ms.clip_by_global_norm is a plain
    # function of the gradients), Adam's apply. ms.compile runs it 3 times per sess.run and
    # returns every step's value of each tensor fetched.
    w = V1.get_variable("w", [2], initializer=V1.zeros_initializer())
    adam = V1.train.AdamOptimizer(0.1)
    loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) - y))
    grads_and_vars = adam.compute_gradients(loss)
    clipped_pairs = ms.clip_by_global_norm(1.0)(grads_and_vars, None)
    train = adam.apply_gradients(clipped_pairs)
    fused = ms.compile({"train": train, "raw": grads_and_vars[0][0],
                        "clipped": clipped_pairs[0][0]}, steps=3, mode="unrolled")
    fetch = [fused.train_op, fused.values["raw"], fused.values["clipped"]]
    slot_m = adam.get_slot(w, "m")  # read after the run: a fetch beside train_op may run first
    m_clipped, m_raw = np.zeros(2), np.zeros(2)
    with V1.Session() as sess:
        sess.run(V1.global_variables_initializer())
        print(f"{'step':>4}  {'raw gradient':>20}  {'clipped gradient':>20}")
        for run in range(3):
            _, raw_g, clipped_g = sess.run(fetch)
            m = sess.run(slot_m)
            for k in range(3):
                m_clipped = 0.9 * m_clipped + 0.1 * clipped_g[k]
                m_raw = 0.9 * m_raw + 0.1 * raw_g[k]
                print(f"{3 * run + k + 1:>4}  {np.array2string(raw_g[k], precision=3):>20}  "
                      f"{np.array2string(clipped_g[k], precision=3):>20}")
            print(f"  after run {run + 1}: Adam m = {np.array2string(m, precision=5)}; "
                  f"average of clipped = {np.array2string(m_clipped, precision=5)}, "
                  f"of raw = {np.array2string(m_raw, precision=3)}")
        print(f"Adam accumulated the clipped gradients: "
              f"max |m - clipped average| = {np.abs(m - m_clipped).max():.1e}, "
              f"max |m - raw average| = {np.abs(m - m_raw).max():.1f}")
