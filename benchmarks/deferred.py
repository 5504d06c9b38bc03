"""The deferred session against the loop as written, in one process, rounds interleaved.

    taskset -c 0 python benchmarks/deferred.py [--model blobs|mlp] [--steps 100] [--rounds 7]

Four figures (issue: the training loop as written):
- the deferral cost of one step run (feed copies, lazy values, bookkeeping): the time of
  a deferred ``run`` call that does not run anything, for a step of 3 fetches and 3 feeds;
- what a step run costs while it runs as written, before its program's build pays back
  (``fuse="when_it_pays"``'s start): multistep's Python over the session's own ``run``;
- blobs (50 points, dense 2 -> 2 from ones, SGD; a batch fed every call, the loss
  accumulated in Python): the loop as written against the same loop with its session
  deferred (``ms.deferred(sess, steps=N)``), without and with XLA;
- ``--model mlp``: the same loops over the feed-a-call MLP tutorial's step at the size the
  tests shrink it to (tests/deferred_cases.py);
- the same loop against the hand port through ``ms.compile`` (the N feed dicts collected,
  ``fused.run(sess, feeds=...)``, the loop body replayed over the returned values).
Each figure is a median of per-round ratios; a round times every variant once, the order
rotated round to round so that a change of load falls on all alike.
"""

import argparse
import statistics
import time
import timeit

import numpy as np
import tensorflow as tf

import multistep as ms

v1 = tf.compat.v1


def blobs_graph():
    from sklearn.datasets import make_blobs

    x_data, labels = make_blobs(n_samples=50, centers=2, n_features=2, random_state=0)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 2], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        lr = v1.placeholder_with_default(0.01, [], name="lr")
        w = v1.get_variable("w", [2, 2], initializer=v1.ones_initializer())
        b = v1.get_variable("b", [2], initializer=v1.zeros_initializer())
        logits = tf.identity(tf.matmul(x, w) + b, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))
        train = v1.train.GradientDescentOptimizer(lr).minimize(loss)
        init = v1.global_variables_initializer()
    feeds = (x, y, lr), (x_data.astype(np.float32), labels.astype(np.int32), np.float32(0.01))
    return graph, train, loss, init, feeds


def mlp_graph():
    """The feed-a-call MLP tutorial's step, at the size tests/deferred_cases.py shrinks it
    to: 6 inputs, 16 hidden units, 3 classes, RMSProp, a batch of 10."""
    rng = np.random.RandomState(3)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.float32, [None, 3], name="y")
        lr = v1.placeholder_with_default(0.01, [], name="lr")
        w1 = v1.get_variable("w1", [6, 16], initializer=v1.glorot_uniform_initializer(seed=1))
        w2 = v1.get_variable("w2", [16, 3], initializer=v1.glorot_uniform_initializer(seed=2))
        logits = tf.identity(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2), name="logits")
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))
        train = v1.train.RMSPropOptimizer(lr).minimize(loss)
        init = v1.global_variables_initializer()
    feeds = (x, y, lr), (rng.randn(10, 6).astype(np.float32),
                         np.eye(3, dtype=np.float32)[rng.randint(0, 3, 10)], np.float32(0.01))
    return graph, train, loss, init, feeds


MODELS = {"blobs": blobs_graph, "mlp": mlp_graph}


def loop(sess, train, loss, feeds, steps):
    """The loop as written: a batch fed every call, the loss summed in Python, read once."""
    keys, values = feeds
    total = 0.0
    for _ in range(steps):
        _, value = sess.run([train, loss], dict(zip(keys, values)))
        total += value
    return float(total)


def hand_port(sess, fused, feeds, steps):
    keys, values = feeds
    total = 0.0
    for start in range(0, steps, fused.steps):
        n = min(fused.steps, steps - start)
        out = fused.run(sess, feeds=[dict(zip(keys, values))] * n)
        for value in out[1]:
            total += value
    return float(total)


def deferral_cost(repeats, calls=1000):
    """Seconds of one deferred run call that runs nothing (N larger than the calls)."""
    graph, train, loss, init, feeds = blobs_graph()
    extra = graph.get_tensor_by_name("logits:0")
    sess = ms.deferred(v1.Session(graph=graph), steps=calls + 1, fuse="at_once")
    sess.run(init)
    keys, values = feeds
    fetches = [train, loss, extra]  # 3 fetches, 3 feeds
    sess.run(fetches, dict(zip(keys, values)))
    sess.flush()  # compiled and run once: what is timed below is the deferral alone
    best = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            sess.run(fetches, dict(zip(keys, values)))
        best.append((time.perf_counter() - start) / calls)
        sess.flush()
    sess.close()
    return statistics.median(best)


def as_written_cost(repeats, calls=20000):
    """Seconds of Python a step run costs while it runs as written (``fuse="when_it_pays"``
    before its build pays back: the default's start), over calling the session's own
    ``run``: the session's run replaced by a stub that returns at once, so that only
    multistep's part is timed."""
    from multistep.loops import deferred as deferred_lib
    from multistep.loops import payback

    graph, train, loss, init, feeds = blobs_graph()
    raw = v1.Session(graph=graph)
    raw.run(init)
    sess = ms.deferred(raw, steps=10)
    feed = dict(zip(*feeds))
    saved = payback.build_estimate, deferred_lib._ORIGINAL["run"]
    payback.build_estimate = lambda ops: float("inf")  # (it never pays: as written)
    try:
        for _ in range(30):
            sess.run([train, loss], feed)  # (timed and decided: the steady path)
        deferred_lib._ORIGINAL["run"] = lambda *args: [None, 1.0]
        own = min(timeit.repeat(lambda: sess.run([train, loss], feed), number=calls,
                                repeat=repeats))
        stub = min(timeit.repeat(lambda: deferred_lib._ORIGINAL["run"](raw, [train, loss],
                                                                       feed),
                                 number=calls, repeat=repeats))
    finally:
        payback.build_estimate, deferred_lib._ORIGINAL["run"] = saved
    return (own - stub) / calls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100, help="N (default 100)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=10, help="N-step blocks a timing")
    parser.add_argument("--model", choices=sorted(MODELS), default="blobs")
    args = parser.parse_args()
    n, total = args.steps, args.steps * args.epochs
    print(f"deferral cost of one step run (3 fetches, 3 feeds): "
          f"{deferral_cost(args.rounds) * 1e6:.1f} us")
    print(f"a step run as written until its build pays (the default's start), multistep's "
          f"part: {as_written_cost(args.rounds) * 1e6:.1f} us")

    variants = {}
    for name, xla in [("as written", None), ("deferred", False), ("deferred+xla", True),
                      ("hand port (ms.compile)", "port")]:
        graph, train, loss, init, feeds = MODELS[args.model]()
        sess = v1.Session(graph=graph)
        if xla == "port":
            with graph.as_default():
                fused = ms.compile([train, loss], steps=n)
            sess.run(init)
            variants[name] = (lambda s=sess, f=fused, fd=feeds: hand_port(s, f, fd, total))
            continue
        if xla is not None:
            sess = ms.deferred(sess, steps=n, xla=xla, fuse="at_once")
        sess.run(init)
        variants[name] = (lambda s=sess, t=train, l=loss, fd=feeds: loop(s, t, l, fd, total))
    for fn in variants.values():
        fn()  # warm up: compiles
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            variants[name]()
            times[name].append((time.perf_counter() - start) / total)
    base = times["as written"]
    print(f"\n{args.model}, a feed every call, N = {n}, {total} steps a timing, "
          f"{args.rounds} rounds (median us a step; ratio: the loop as written / the variant)")
    for name in names:
        ratio = statistics.median(a / b for a, b in zip(base, times[name]))
        print(f"  {name:<24} {statistics.median(times[name]) * 1e6:8.1f} us   {ratio:5.2f}x")
    port = times["hand port (ms.compile)"]
    print(f"  deferred / hand port speed-up: "
          f"{statistics.median(p / d for p, d in zip(port, times['deferred'])):.2f}")


if __name__ == "__main__":
    v1.disable_eager_execution()
    main()
