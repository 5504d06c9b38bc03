"""A newcomer's own training script (the test of never slower): a two-layer MLP fed a
batch a call, the loss printed every 50 steps, an evaluation every 100, a checkpoint at
the end. The step count comes from the command line."""
import os
import sys

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
tf.compat.v1.set_random_seed(0)
rng = np.random.RandomState(0)
X = rng.randn(512, 8).astype(np.float32)
Y = (X[:, :4].sum(1) > X[:, 4:].sum(1)).astype(np.int64)
x = tf.compat.v1.placeholder(tf.float32, [None, 8])
y = tf.compat.v1.placeholder(tf.int64, [None])
w1 = tf.compat.v1.get_variable("w1", [8, 32])
b1 = tf.compat.v1.get_variable("b1", [32], initializer=tf.compat.v1.zeros_initializer())
w2 = tf.compat.v1.get_variable("w2", [32, 2])
b2 = tf.compat.v1.get_variable("b2", [2], initializer=tf.compat.v1.zeros_initializer())
logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2
loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
step = tf.compat.v1.train.get_or_create_global_step()
train = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
saver = tf.compat.v1.train.Saver()
steps = int(sys.argv[1])
with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    for i in range(steps):
        start = (i * 32) % 512
        _, value = sess.run([train, loss], {x: X[start:start + 32], y: Y[start:start + 32]})
        if (i + 1) % 50 == 0:
            print(f"step {i + 1}: loss {value:.4f}")
        if (i + 1) % 100 == 0:
            print(f"accuracy {sess.run(accuracy, {x: X, y: Y}):.4f}")
    os.makedirs("checkpoints", exist_ok=True)
    saver.save(sess, os.path.join("checkpoints", "model"), global_step=step)
