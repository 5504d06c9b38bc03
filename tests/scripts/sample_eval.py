"""A loop whose deferred form must differ (the planted difference of `multistep verify`):
its step samples with tf.random.categorical (Multinomial, whose stream no stateless op
continues, so it is not shared) and its evaluation runs that sampler too: as written the
evaluation's draws interleave with the steps'; deferred, the steps draw from their
compiled program's own copy."""
import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
tf.compat.v1.set_random_seed(1)
rng = np.random.RandomState(1)
X = rng.randn(40, 4).astype(np.float32)
x = tf.compat.v1.placeholder(tf.float32, [None, 4])
w = tf.compat.v1.get_variable("w", [4, 3])
logits = tf.matmul(x, w)
sample = tf.random.categorical(logits, 1, seed=2)[:, 0]
loss = tf.reduce_mean(tf.square(tf.gather(logits, sample, batch_dims=1) - 1))
train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    for i in range(8):
        sess.run(train, {x: X[i * 5:(i + 1) * 5]})
        if i % 4 == 3:
            print("loss of a sample", sess.run(loss, {x: X}))
