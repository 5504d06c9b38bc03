"""A script that imports nothing before it prints what is loaded, seeds numpy before
importing TensorFlow, logs through TensorFlow's logger, and defers its own session (with
ms.deferred): under multistep run, TensorFlow is not loaded before the script, its
warning line is printed, and its own deferral wins (one line says so)."""
import sys

print("loaded before the script:", "tensorflow" in sys.modules, "numpy" in sys.modules)
import numpy as np  # noqa: E402

np.random.seed(0)
import tensorflow as tf  # noqa: E402

import multistep as ms  # noqa: E402

tf.compat.v1.disable_eager_execution()
tf.compat.v1.set_random_seed(0)
tf.compat.v1.logging.warning("the script's own warning")
x = tf.compat.v1.placeholder(tf.float32, [None, 2])
w = tf.compat.v1.get_variable("w", [2, 1])
loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
sess = tf.compat.v1.Session()
sess.run(tf.compat.v1.global_variables_initializer())
sess = ms.deferred(sess, steps=3, fuse="at_once")
losses = [sess.run([train, loss], {x: np.random.rand(4, 2)})[1] for _ in range(6)]
print("losses", [float(v) for v in losses])
print("report", sess.report().runs)
sess.close()
