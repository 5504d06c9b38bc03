"""What a shared random stream costs a step (multistep.compiler.streams): the step of a
dropout MLP as written (its ``RandomUniform`` kernels) against the same step with its
streams shared (each dropout reads a stateless op on a counter of the session's), run by
plain ``sess.run``. The tutorial's shapes: batches of 64 of 784 inputs, two hidden layers
of 256 with dropout on a fed ``keep_prob`` (two independent random ops: the counters
must not serialise them), 10 classes, Adam. A second model, blobs' size (a step of tens
of microseconds), shows the fixed cost's largest share. Two sessions, interleaved round
by round; the ratio paired (a round's shared time over the same round's as-written
time), medians.

And what the session hook that makes the streams possible costs every run of every
session in a process that imported multistep (the last row).

    taskset -c 0 python benchmarks/streams.py [--rounds 9] [--calls 300]
"""

import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

import multistep  # noqa: F401 (installs the session hook)
from multistep.compiler import streams

V1 = tf.compat.v1


def build(shared, size):
    """(session, a callable of one training step)."""
    inputs, hidden, batch = {"mlp": (784, 256, 64), "blobs": (2, 16, 16)}[size]
    graph = tf.Graph()
    with graph.as_default():
        V1.set_random_seed(0)
        rng = np.random.RandomState(0)
        x = V1.placeholder(tf.float32, [None, inputs], "x")
        y = V1.placeholder(tf.int32, [None], "y")
        keep_prob = V1.placeholder(tf.float32, name="keep_prob")
        h = x
        for i in range(2):
            w = V1.get_variable(f"w{i}", [h.shape[-1], hidden])
            h = tf.nn.dropout(tf.nn.relu(tf.matmul(h, w)), rate=1 - keep_prob)
        logits = tf.matmul(h, V1.get_variable("out", [hidden, 10]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))
        train = V1.train.AdamOptimizer(1e-3).minimize(loss)
        init = V1.global_variables_initializer()
    if shared:
        assert not streams.share(graph).kept
    sess = V1.Session(graph=graph)
    sess.run(init)
    feed = {x: rng.rand(batch, inputs).astype(np.float32),
            y: rng.randint(0, 10, batch).astype(np.int32), keep_prob: 0.8}
    step = sess.make_callable([train, loss], feed_list=list(feed))
    values = list(feed.values())
    return sess, lambda: step(*values)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    print(f"{'model':6s} {'as written':>12s} {'shared':>12s} {'ratio':>7s}  (µs a step, "
          f"medians of {args.rounds} rounds of {args.calls} calls)")
    for size in ("mlp", "blobs"):
        plain, shared = build(False, size), build(True, size)
        for _, step in (plain, shared):
            for _ in range(50):
                step()
        times = {0: [], 1: []}
        ratios = []
        for _ in range(args.rounds):
            this = []
            for which, (_, step) in enumerate((plain, shared)):
                start = time.perf_counter()
                for _ in range(args.calls):
                    step()
                this.append((time.perf_counter() - start) / args.calls * 1e6)
                times[which].append(this[-1])
            ratios.append(this[1] / this[0])
        print(f"{size:6s} {statistics.median(times[0]):12.1f} {statistics.median(times[1]):12.1f} "
              f"{statistics.median(ratios):7.3f}  (paired ratios {min(ratios):.3f}-"
              f"{max(ratios):.3f})")
        for sess, _ in (plain, shared):
            sess.close()
    hook_cost(args.rounds, args.calls * 3)


def hook_cost(rounds, calls):
    """What the session hook (``multistep._session_hook``: one wrapped ``_extend_graph``
    a run) costs the smallest run there is, a constant fetched: the hook against
    TensorFlow's own method, swapped round by round in one process, paired."""
    from tensorflow.python.client import session as session_lib

    from multistep import _session_hook

    graph = tf.Graph()
    with graph.as_default():
        one = tf.constant(1.0) + 1.0
    sess = V1.Session(graph=graph)
    methods = (_session_hook._STATE["extend"], session_lib.BaseSession._extend_graph)  # noqa: SLF001
    times, ratios = {0: [], 1: []}, []
    for _ in range(rounds):
        this = []
        for which, method in enumerate(methods):
            session_lib.BaseSession._extend_graph = method  # noqa: SLF001
            start = time.perf_counter()
            for _ in range(calls):
                sess.run(one)
            this.append((time.perf_counter() - start) / calls * 1e6)
            times[which].append(this[-1])
        ratios.append(this[1] / this[0])
    session_lib.BaseSession._extend_graph = methods[1]  # noqa: SLF001
    print(f"{'hook':6s} {statistics.median(times[0]):12.1f} {statistics.median(times[1]):12.1f} "
          f"{statistics.median(ratios):7.3f}  (a constant's run: TensorFlow's own method, "
          f"then the hook; paired ratios {min(ratios):.3f}-{max(ratios):.3f})")
    sess.close()


if __name__ == "__main__":
    main()
