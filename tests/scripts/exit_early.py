"""A loop whose step also writes the global step to a file (tf.io.write_file after the
apply), that makes 3 steps and leaves by os._exit (no atexit, no close). As written the
file holds 3; deferred, the 3 steps are pending at os._exit and must run before it."""
import os
import sys

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
x = tf.compat.v1.placeholder(tf.float32, [None, 2])
w = tf.compat.v1.get_variable("w", [2, 1], initializer=tf.compat.v1.ones_initializer())
loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
step = tf.compat.v1.train.get_or_create_global_step()
train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
with tf.control_dependencies([train]):
    record = tf.io.write_file(sys.argv[1], tf.strings.as_string(step.read_value()))
sess = tf.compat.v1.Session()
sess.run(tf.compat.v1.global_variables_initializer())
for _ in range(3):
    sess.run(record, {x: np.ones([2, 2], np.float32)})
os._exit(0)
