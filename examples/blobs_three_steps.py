"""The three-step blobs classifier, done right.

The common recipe builds ``logits = dense(x)`` once and chains three
``apply_gradients`` with ``tf.control_dependencies``. Then the forward pass runs
once per ``sess.run`` and all three "steps" apply the gradient of the old
weights. ``ms.unroll`` takes a loss *function* instead, rebuilds the forward
pass inside every step, and refuses the broken graph.

    python examples/blobs_three_steps.py
"""

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import make_blobs

import multistep as ms

V1 = tf.compat.v1
x, y = make_blobs(n_samples=50, centers=2, n_features=2, random_state=0)
x, y = x.astype(np.float32), y.astype(np.int32)

with tf.Graph().as_default():
    dense = keras.layers.Dense(2, kernel_initializer="ones", name="dense")

    def loss_fn():
        logits = dense(x)  # rebuilt at every inner step, on the updated weights
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

    # The broken recipe is refused at build time.
    stale_logits = dense(x)
    try:
        ms.unroll(lambda: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=stale_logits)), V1.train.GradientDescentOptimizer(0.01), 3)
    except ms.StaleForwardError as error:
        print("refused:", str(error).split(". ")[0] + ".")

    three = ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.01), steps=3,
                      global_step=V1.train.get_or_create_global_step())
    predictions = tf.argmax(dense(x), axis=1)
    with V1.Session() as sess:
        sess.run(V1.global_variables_initializer())
        for run in range(4):
            _, losses = sess.run([three.train_op, three.losses])
            print(f"run {run + 1}: losses of its 3 steps {np.round(losses, 6)}")
        accuracy = np.mean(sess.run(predictions) == y)
        print(f"global step {sess.run(V1.train.get_global_step())}, accuracy {accuracy:.2f}")
