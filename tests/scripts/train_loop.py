"""A feed-a-call training loop as a user writes it (the test of `multistep run`): epochs
from the command line, a loss accumulated in Python, an evaluation every other epoch."""
import sys

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
tf.compat.v1.set_random_seed(0)
rng = np.random.RandomState(0)
X = rng.randn(80, 4).astype(np.float32)
Y = (X.sum(1, keepdims=True) > 0).astype(np.float32)
x = tf.compat.v1.placeholder(tf.float32, [None, 4])
y = tf.compat.v1.placeholder(tf.float32, [None, 1])
w = tf.compat.v1.get_variable("w", [4, 1])
logits = tf.matmul(x, w)
loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))
train = tf.compat.v1.train.AdamOptimizer(0.05).minimize(loss)
accuracy = tf.reduce_mean(tf.cast(tf.equal(logits > 0, y > 0.5), tf.float32))
epochs = int(sys.argv[1])
with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    for epoch in range(epochs):
        total = 0.0
        for i in range(8):
            _, value = sess.run([train, loss], {x: X[i * 10:(i + 1) * 10], y: Y[i * 10:(i + 1) * 10]})
            total += value / 8
        print(f"epoch {epoch}: loss {total!r}")
        if epoch % 2 == 1:
            print(f"accuracy {sess.run(accuracy, {x: X, y: Y})!r}")
    if len(sys.argv) > 2 and sys.argv[2] == "raise":
        for i in range(3):  # deferred, then the script fails: they still run, as written
            sess.run(train, {x: X[:10], y: Y[:10]})
        raise RuntimeError("the script's own error")
