"""A public convnet as its loop runs it: TensorFlow's TF1 "Deep MNIST for experts"
tutorial (two 5 x 5 convolutions of 32 and 64 channels with 2 x 2 max pooling, a dense
layer of 1024, dropout at keep_prob 0.5, Adam 1e-4, batches of 50 fed by a feed dict),
its single steps against ``ms.compile``'s loop mode of the same step (N batches fed at
once, ``fused.run``). Three methods, each in a graph of its own (so the single steps
carry no tripwires), interleaved round by round in one process:

- ``sess.run``: N calls of ``sess.run([loss, train], feed_dict)``, as the tutorial runs;
- ``make_callable``: N calls of a callable of the same fetches and feeds;
- ``compile loop``: one ``fused.run(sess, {x: [N, 50, 784], ...})``.

Prints µs a step (median of the rounds) and sess.run's time over each method's, paired
round by round (above 1: faster than the tutorial's loop). ``--preamble v1`` builds
under ``disable_v2_behavior()`` (ref variables, v1 control flow), as TF1 programs run.

    taskset -c 0 python benchmarks/mnist_tutorial.py [--steps 4 16] [--rounds 7] [--preamble v1]
"""

import argparse
import statistics
import time
import warnings

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1


def program():
    """The tutorial's graph: (x, y, keep_prob, loss, train)."""
    V1.set_random_seed(0)
    x = V1.placeholder(tf.float32, [None, 784], "x")
    y = V1.placeholder(tf.int64, [None], "y")
    keep_prob = V1.placeholder(tf.float32, [], "keep_prob")

    def weight(shape):
        return V1.Variable(V1.truncated_normal(shape, stddev=0.1, seed=1))

    def bias(shape):
        return V1.Variable(tf.constant(0.1, shape=shape))

    h = tf.reshape(x, [-1, 28, 28, 1])
    for before, after in ((1, 32), (32, 64)):
        h = tf.nn.conv2d(h, weight([5, 5, before, after]), [1, 1, 1, 1], "SAME")
        h = tf.nn.max_pool2d(tf.nn.relu(h + bias([after])), 2, 2, "SAME")
    h = tf.nn.relu(tf.matmul(tf.reshape(h, [-1, 7 * 7 * 64]), weight([3136, 1024]))
                   + bias([1024]))
    h = tf.nn.dropout(h, rate=1 - keep_prob)
    logits = tf.matmul(h, weight([1024, 10])) + bias([10])
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return x, y, keep_prob, loss, V1.train.AdamOptimizer(1e-4).minimize(loss)


def methods(steps, images, labels):
    """{name: a function that runs ``steps`` steps}, each in a session of its own graph."""
    runners, sessions = {}, []
    for name in ("sess.run", "make_callable", "compile loop"):
        graph = tf.Graph()
        with graph.as_default():
            x, y, keep_prob, loss, train = program()
            if name == "compile loop":
                with warnings.catch_warnings():  # the dropout's stream: not timed here
                    warnings.simplefilter("ignore")
                    fused = ms.compile({"loss": loss, "train": train}, steps=steps)
            sess = V1.Session(graph=graph)
            sess.run(V1.global_variables_initializer())
        sessions.append(sess)
        if name == "sess.run":
            def run(sess=sess, x=x, y=y, keep_prob=keep_prob, fetch=[loss, train]):
                for k in range(steps):
                    sess.run(fetch, {x: images[k], y: labels[k], keep_prob: 0.5})
        elif name == "make_callable":
            call = sess.make_callable([loss, train], [x, y, keep_prob])

            def run(call=call):
                for k in range(steps):
                    call(images[k], labels[k], 0.5)
        else:
            def run(sess=sess, fused=fused, feed={x: images, y: labels, keep_prob: 0.5}):
                fused.run(sess, feed)
        runners[name] = run
    return runners, sessions


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--preamble", choices=["v2", "v1"], default="v2",
                        help="v2: disable_eager_execution() (default); v1: "
                             "disable_v2_behavior()")
    args = parser.parse_args()
    if args.preamble == "v1":
        V1.disable_v2_behavior()
    else:
        V1.disable_eager_execution()
    rng = np.random.RandomState(0)
    print(f"{'N':>3}  {'method':<14} {'µs/step':>9}  sess.run / method, paired")
    for steps in args.steps:
        images = rng.rand(steps, 50, 784).astype(np.float32)
        labels = rng.randint(0, 10, (steps, 50)).astype(np.int64)
        runners, sessions = methods(steps, images, labels)
        for run in runners.values():
            run()  # warm-up: oneDNN's primitives, the allocator
        samples = {name: [] for name in runners}
        for _ in range(args.rounds):  # interleaved: a slow moment hits every method
            for name, run in runners.items():
                start = time.perf_counter()
                run()
                samples[name].append((time.perf_counter() - start) / steps * 1e6)
        for sess in sessions:
            sess.close()
        for name, times in samples.items():
            paired = statistics.median(s / t for s, t in zip(samples["sess.run"], times))
            print(f"{steps:>3}  {name:<14} {statistics.median(times):>9.1f}  {paired:.3f}x",
                  flush=True)


if __name__ == "__main__":
    main()
