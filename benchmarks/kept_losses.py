"""The memory of a loop that keeps every loss it fetches (``losses.append(loss)``), as
written and deferred: the bytes each kept loss holds, traced by ``tracemalloc`` over the
loop (each mode in a process of its own).

    python benchmarks/kept_losses.py [--steps 5000]
"""
import argparse
import gc
import subprocess
import sys
import tracemalloc


def measure(mode, steps):
    import numpy as np
    import tensorflow as tf

    import multistep as ms

    v1 = tf.compat.v1
    v1.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3])
        w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        train = v1.train.GradientDescentOptimizer(1e-4).minimize(loss)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    if mode == "deferred":
        sess = ms.deferred(sess, steps=10, fuse="at_once")  # (the lazy values measured)
    sess.run(init)
    batch = np.ones([4, 3], np.float32)
    for _ in range(20):  # (the program built and run before the count)
        sess.run([train, loss], {x: batch})
    float(sess.run(loss, {x: batch}))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    losses = [sess.run([train, loss], {x: batch})[1] for _ in range(steps)]
    float(losses[-1])
    gc.collect()
    return (tracemalloc.get_traced_memory()[0] - before) / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--mode", choices=["written", "deferred"])
    args = parser.parse_args()
    if args.mode:
        print(measure(args.mode, args.steps))
        return
    got = {}
    for mode in ("written", "deferred"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--steps",
                              str(args.steps)], capture_output=True, text=True, check=True)
        got[mode] = float(out.stdout.split()[-1])
        print(f"{mode:9s} {got[mode]:7.0f} bytes a kept loss ({args.steps} steps)")
    print(f"deferred / as written: {got['deferred'] / got['written']:.1f}x")


if __name__ == "__main__":
    main()
