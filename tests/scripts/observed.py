"""A loop whose run leaves more than Session.run values, for `multistep verify`.

`python observed.py ok`: reads its step count from standard input, resumes from its own
checkpoint folder (./ckpt, made by the first run in a fresh folder), saves there and under
tempfile.mkdtemp(), and writes its losses to ./losses.json: verify must call it OK (each
run in a copy of the working directory, fed the same standard input; temporary names
masked). `python observed.py line` prints the name of a fetched loss's type,
`python observed.py file` writes it to ./kind.json, `python observed.py error` to standard
error: all differ deferred (type() of a
lazy value is Lazy, whatever isinstance answers), and verify must say so."""
import json
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

mode = sys.argv[1]
tf.compat.v1.disable_eager_execution()
tf.compat.v1.set_random_seed(0)
x = tf.compat.v1.placeholder(tf.float32, [None, 2])
w = tf.compat.v1.get_variable("w", [2, 1])
loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
saver = tf.compat.v1.train.Saver()
steps = int(sys.stdin.readline()) if mode == "ok" else 6
data = np.random.RandomState(0).rand(steps, 4, 2).astype(np.float32)
with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    if mode == "ok" and os.path.exists("ckpt/checkpoint"):
        saver.restore(sess, tf.train.latest_checkpoint("ckpt"))
        print("resumed")
    losses = [sess.run([train, loss], {x: batch})[1] for batch in data]
    if mode == "ok":
        saver.save(sess, "ckpt/model", global_step=steps)
        saver.save(sess, os.path.join(tempfile.mkdtemp(), "model"))
        with open("losses.json", "w") as f:
            json.dump([float(v) for v in losses], f)
    kind = type(losses[-1]).__name__  # (what Python cannot be told otherwise: type())
    if mode == "line":
        print("the last loss is", kind)
    if mode == "error":
        print("the last loss is", kind, file=sys.stderr)
    if mode == "file":
        with open("kind.json", "w") as f:
            json.dump(kind, f)
    print("losses", [round(float(v), 6) for v in losses])
