"""What a feed costs a run: ``make_callable`` of ``x + 1`` on a 50 x 2 float32 array,
as a constant and fed, and of ``y + 1`` on a fed scalar. Interleaved rounds, medians.

    taskset -c 0 python benchmarks/feed_cost.py
"""

import statistics
import time

import numpy as np
import tensorflow as tf

V1 = tf.compat.v1


def main(rounds=7, calls=2000):
    with tf.Graph().as_default() as graph:
        x = V1.placeholder(tf.float32, [50, 2])
        y = V1.placeholder(tf.float32, [])
        constant = tf.constant(np.ones([50, 2], np.float32))
    session = V1.Session(graph=graph)
    data = np.ones([50, 2], np.float32)
    with graph.as_default():
        runs = {"constant, no feed": session.make_callable(constant + 1),
                "50 x 2 array fed": session.make_callable(x + 1, feed_list=[x]),
                "scalar fed": session.make_callable(y + 1, feed_list=[y])}
    args = {"constant, no feed": (), "50 x 2 array fed": (data,), "scalar fed": (1.0,)}
    times = {name: [] for name in runs}
    for r in range(rounds):
        names = list(runs)
        for name in names[r % 3:] + names[:r % 3]:
            call, given = runs[name], args[name]
            call(*given)
            began = time.perf_counter()
            for _ in range(calls):
                call(*given)
            times[name].append((time.perf_counter() - began) / calls * 1e6)
    for name, t in times.items():
        print(f"{name:<20} {statistics.median(t):7.1f} µs a run (median of {rounds} rounds)")


if __name__ == "__main__":
    main()
