"""A loop whose evaluation runs the step's own dropout, so it draws from the stream the
training steps draw from. Deferred, the dropout's stream is shared by the compiled steps
and the evaluation (multistep.compiler.streams): bitwise as written."""
import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
tf.compat.v1.set_random_seed(1)
rng = np.random.RandomState(1)
X = rng.randn(40, 4).astype(np.float32)
x = tf.compat.v1.placeholder(tf.float32, [None, 4])
w = tf.compat.v1.get_variable("w", [4, 1])
loss = tf.reduce_mean(tf.square(tf.nn.dropout(tf.matmul(x, w), rate=0.5, seed=2) - 1))
train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    for i in range(8):
        sess.run(train, {x: X[i * 5:(i + 1) * 5]})
        if i % 4 == 3:
            print("loss with dropout on", sess.run(loss, {x: X}))
