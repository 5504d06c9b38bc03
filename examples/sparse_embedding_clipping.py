"""Clipping sparse gradients: a cap must apply to the summed row, not to each lookup.

An embedding row looked up twice gets two gradient rows, [3, 3] at indices
[0, 0]. Capping each at 4 lets the row move by 6; ``ms.clip_by_value`` sums
rows per index first (``ms.dedupe_sparse``), so the row moves by 4, exactly as
with the dense gradient of the same loss.

    python examples/sparse_embedding_clipping.py
"""

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
IDS = np.array([0, 0, 2], np.int32)  # row 0 looked up twice


def row_change(clip, *, dense=False):
    with tf.Graph().as_default():
        def loss_fn():
            emb = V1.get_variable("emb", [3, 1], initializer=V1.zeros_initializer())
            rows = tf.matmul(tf.one_hot(IDS, 3), emb) if dense else tf.gather(emb, IDS)
            return tf.reduce_sum(rows * np.array([[-3.0], [-3.0], [-1.0]], np.float32))

        fused = ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(1.0), 1, grad_transforms=[clip])
        [emb] = fused.var_list
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(fused.train_op)
            return sess.run(emb).ravel()


def clip_each_lookup(grads_and_vars, step):
    """The naive cap: clips an IndexedSlices' values row by row, duplicates and all."""
    return [(tf.IndexedSlices(tf.clip_by_value(g.values, -4.0, 4.0), g.indices, g.dense_shape), v)
            for g, v in grads_and_vars]


if __name__ == "__main__":
    # ms.unroll sums duplicates before any transform; call the naive cap standalone to show the trap.
    with tf.Graph().as_default():
        g = tf.IndexedSlices(tf.constant([[-3.0], [-3.0], [-1.0]]), tf.constant(IDS), tf.constant([3, 1]))
        naive = tf.math.unsorted_segment_sum(clip_each_lookup([(g, None)], None)[0][0].values, IDS, 3)
        with V1.Session() as sess:
            print("cap per lookup:       row 0 moves by", -sess.run(naive)[0, 0])
    print("ms.clip_by_value(-4, 4), sparse: rows after one step", row_change(ms.clip_by_value(-4.0, 4.0)))
    print("ms.clip_by_value(-4, 4), dense:  rows after one step",
          row_change(ms.clip_by_value(-4.0, 4.0), dense=True))
    print("ms.clip_by_global_norm(2), sparse:", row_change(ms.clip_by_global_norm(2.0)).round(6),
          " dense:", row_change(ms.clip_by_global_norm(2.0), dense=True).round(6))
