"""What ``ms.compile`` costs the user's own single step: the original train op run by
``sess.run`` in a graph where it was compiled (its tripwires in place) against the same
step in a graph where it was not. A CIFAR-sized step: batches of 8 of 32 x 32 x 3 from
a ``tf.data`` iterator, two 3 x 3 convolutions (8, 16 channels) with 2 x 2 max pooling,
dropout, a dense layer of 10, Adam, a global step: every kind of op a tripwire guards
(an input, a random op, writes). Two sessions, interleaved round by round, the ratio
paired (a round's compiled time over the same round's plain time), medians.

And what the watch costs the compiled program: a run of ``ms.compile``'s program (its
first step waits on the tripwires' check) against the same program built without
tripwires (``compile_program(..., tripwires=False)``, as the deferred session builds
it), on the same step and on ``multistep blobs``' (a step of microseconds, where the
check's share is largest), 3 steps a run.

    taskset -c 0 python benchmarks/tripwire_cost.py [--rounds 9] [--calls 300]
"""

import argparse
import statistics
import time
import warnings

import numpy as np
import tensorflow as tf

from multistep.compiler.compile import compile_program

V1 = tf.compat.v1


def build(compiled, model="cifar", tripwires=True):
    """(session, a callable of the original step) or, ``compiled="program"``, of the
    compiled program."""
    graph = tf.Graph()
    with graph.as_default():
        if model == "blobs":
            return _blobs(graph, tripwires)
        V1.set_random_seed(0)
        rng = np.random.RandomState(0)
        images = rng.rand(256, 32, 32, 3).astype(np.float32)
        labels = rng.randint(0, 10, 256).astype(np.int32)
        x, y = V1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices((images, labels)).repeat().batch(8)).get_next()
        h = x
        for channels in (8, 16):
            h = _conv(h, channels)
            h = tf.nn.max_pool2d(h, 2, 2, "SAME")
        h = tf.nn.dropout(tf.reshape(h, [8, 8 * 8 * 16]), rate=0.5)
        w = V1.get_variable("out", [8 * 8 * 16, 10])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(h, w)))
        train = V1.train.AdamOptimizer(1e-3).minimize(
            loss, global_step=V1.train.get_or_create_global_step())
        fused = None
        if compiled:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (dropout in loop mode: said, and known)
                fused = compile_program([loss, train], steps=3, tripwires=tripwires)
        init = V1.global_variables_initializer()
    sess = V1.Session(graph=graph)
    sess.run(init)
    fetch = fused.values if compiled == "program" else [loss, train]
    return sess, sess.make_callable(fetch)


def _blobs(graph, tripwires):
    from multistep.tools.blobs import data

    x, y = data(0)
    w = V1.get_variable("w", initializer=np.ones([2, 2], np.float32))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(tf.constant(x), w)))
    train = V1.train.GradientDescentOptimizer(0.01).minimize(loss)
    fused = compile_program([loss, train], steps=3, tripwires=tripwires)
    sess = V1.Session(graph=graph)
    sess.run(V1.global_variables_initializer())
    return sess, sess.make_callable(fused.values)


def _conv(h, channels):
    w = V1.get_variable(f"conv{channels}", [3, 3, h.shape[-1], channels])
    return tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME"))


def _timed(runs, rounds, calls):
    """{name: [µs a call, a round]}, the runs interleaved, their order alternating."""
    times = {name: [] for name in runs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the tripwires' warnings: the cost is the question)
        for r in range(rounds):
            for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                call = runs[name][1]
                call()
                began = time.perf_counter()
                for _ in range(calls):
                    call()
                times[name].append((time.perf_counter() - began) / calls * 1e6)
    return times


def _report(times, base, other):
    for name, t in times.items():
        print(f"{name:<32} {statistics.median(t):8.1f} µs")
    ratio = statistics.median(o / b for b, o in zip(times[base], times[other]))
    print(f"{other} / {base}: {ratio:.3f}x (median of the rounds' own ratios)\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    print(f"a sess.run of the original step (median of {args.rounds} rounds):")
    times = _timed({"as written": build(False), "after ms.compile": build(True)},
                   args.rounds, args.calls)
    _report(times, "as written", "after ms.compile")
    for model in ("cifar", "blobs"):
        print(f"a run of the 3-step compiled program, {model} (median of {args.rounds} "
              f"rounds):")
        times = _timed({"without tripwires": build("program", model, tripwires=False),
                        "with tripwires (ms.compile)": build("program", model)},
                       args.rounds, args.calls)
        _report(times, "without tripwires", "with tripwires (ms.compile)")


if __name__ == "__main__":
    main()
