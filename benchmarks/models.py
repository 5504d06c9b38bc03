"""Fused against single steps on five real models: is a fused run ever slower?

Models (TF1 graph mode, Adam, full batch held in the graph):
- `mlp`: 3 hidden layers of 256 (relu), batch 128, 64 features, 10 classes;
- `autoencoder`: 784 -> 256 -> 64 -> 256 -> 784 (relu, sigmoid out), batch 128, MSE;
- `lstm`: one LSTM layer of 64 over 16 time steps (written with tf.matmul: no tf-keras),
  batch 32, 16 features, 10 classes on the last state;
- `bn_mlp`: 2 hidden layers of 256 with batch normalisation (moving mean and variance
  updated through UPDATE_OPS, as a single step runs them), batch 128;
- `convnet`: the TF1 MNIST tutorial's shape, smaller: two 5x5 convolutions (16, 32
  channels) each with ReLU and 2x2 max pooling, a dense layer of 128, batch 32 of
  28x28x1 (oneDNN's convolution and pooling kernels: loop mode must run the same);
- `blobs`: `multistep bench`'s problem, 50 points in 2-D and one dense layer.

Methods, each run through `make_callable`, interleaved round by round in one process:
- `single`: the canonical single step (`minimize` under UPDATE_OPS), N calls;
- `ms.unroll auto`: `ms.unroll(..., mode="auto")`, what it picks for the model;
- `ms.unroll`: `ms.unroll` unrolled (the default mode); `ms.unroll loop`: its loop mode;
  `ms.unroll loop+xla`: loop mode under XLA (the three modes `mode="auto"` times);
- `compile loop` / `compile unrolled`: the single step above, `ms.compile`d;
- `empty call`: a call that fetches a constant and a `tf.no_op` (as the single step
  fetches a loss and an op), once a step: what a `sess.run` costs beyond its kernels,
  which fusing removes (the steps' kernels are the same).
Prints µs per step (median of the rounds) and single / fused: above 1 is faster fused
(the best fused method's, and `mode="auto"`'s as the median of the rounds' own ratios),
and auto against the fastest of the modes it times (the median of the rounds' auto /
fastest: above 1 is auto slower) with its build time beside its mode's built directly.
With `empty call` measured, also what removing the calls' own cost alone gives (the
fused run's kernels are the single step's): single / (single - empty call * (1 - 1/N)),
one call of N steps staying. A ratio far from it comes from elsewhere: the machine's
noise, or how one run allocates for and schedules the same kernels.

    taskset -c 0 python benchmarks/models.py [--steps 4 16 64] [--models mlp ...] [--rounds 5]
"""

import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
_rng = np.random.RandomState(0)


def _dense(h, units, name, activation=None):
    w = V1.get_variable(f"{name}/kernel", [h.shape[-1], units],
                        initializer=V1.glorot_uniform_initializer(seed=1))
    b = V1.get_variable(f"{name}/bias", [units], initializer=V1.zeros_initializer())
    h = tf.matmul(h, w) + b
    return activation(h) if activation else h


def _xent(logits, labels):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def mlp():
    x = _rng.randn(128, 64).astype(np.float32)
    y = _rng.randint(0, 10, 128).astype(np.int32)

    def loss_fn():
        h = x
        for i in range(3):
            h = _dense(h, 256, f"hidden{i}", tf.nn.relu)
        return _xent(_dense(h, 10, "out"), y)
    return loss_fn


def autoencoder():
    x = _rng.rand(128, 784).astype(np.float32)

    def loss_fn():
        h = _dense(x, 256, "enc1", tf.nn.relu)
        h = _dense(h, 64, "code", tf.nn.relu)
        h = _dense(h, 256, "dec1", tf.nn.relu)
        return tf.reduce_mean(tf.square(_dense(h, 784, "out", tf.sigmoid) - x))
    return loss_fn


def lstm():
    x = _rng.randn(32, 16, 16).astype(np.float32)
    y = _rng.randint(0, 10, 32).astype(np.int32)

    def loss_fn():
        w = V1.get_variable("lstm/kernel", [16 + 64, 4 * 64],
                            initializer=V1.glorot_uniform_initializer(seed=2))
        b = V1.get_variable("lstm/bias", [4 * 64], initializer=V1.zeros_initializer())
        h = c = tf.zeros([32, 64])
        for t in range(16):
            i, f, g, o = tf.split(tf.matmul(tf.concat([x[:, t], h], 1), w) + b, 4, axis=1)
            c = tf.sigmoid(f + 1.0) * c + tf.sigmoid(i) * tf.tanh(g)
            h = tf.sigmoid(o) * tf.tanh(c)
        return _xent(_dense(h, 10, "out"), y)
    return loss_fn


def bn_mlp():
    x = _rng.randn(128, 64).astype(np.float32)
    y = _rng.randint(0, 10, 128).astype(np.int32)

    def batch_norm(h, name):
        units = h.shape[-1]
        gamma = V1.get_variable(f"{name}/gamma", [units], initializer=V1.ones_initializer())
        beta = V1.get_variable(f"{name}/beta", [units], initializer=V1.zeros_initializer())
        moving_mean = V1.get_variable(f"{name}/moving_mean", [units], trainable=False,
                                      initializer=V1.zeros_initializer())
        moving_var = V1.get_variable(f"{name}/moving_variance", [units], trainable=False,
                                     initializer=V1.ones_initializer())
        mean, var = tf.nn.moments(h, [0])
        for moving, value in ((moving_mean, mean), (moving_var, var)):
            V1.add_to_collection(V1.GraphKeys.UPDATE_OPS,
                                 moving.assign_sub(0.01 * (moving - value)))
        return tf.nn.batch_normalization(h, mean, var, beta, gamma, 1e-3)

    def loss_fn():
        h = x
        for i in range(2):
            h = tf.nn.relu(batch_norm(_dense(h, 256, f"hidden{i}"), f"bn{i}"))
        return _xent(_dense(h, 10, "out"), y)
    return loss_fn


def convnet():
    x = _rng.rand(32, 28, 28, 1).astype(np.float32)
    y = _rng.randint(0, 10, 32).astype(np.int32)

    def conv(h, channels, name):
        w = V1.get_variable(f"{name}/kernel", [5, 5, h.shape[-1], channels],
                            initializer=V1.glorot_uniform_initializer(seed=3))
        b = V1.get_variable(f"{name}/bias", [channels], initializer=V1.zeros_initializer())
        h = tf.nn.relu(tf.nn.conv2d(h, w, strides=1, padding="SAME") + b)
        return tf.nn.max_pool2d(h, 2, 2, padding="SAME")

    def loss_fn():
        h = conv(conv(x, 16, "conv1"), 32, "conv2")
        h = _dense(tf.reshape(h, [32, 7 * 7 * 32]), 128, "dense", tf.nn.relu)
        return _xent(_dense(h, 10, "out"), y)
    return loss_fn


def blobs():
    """multistep blobs' problem (`multistep bench`'s): 50 points in 2-D, one dense layer."""
    from multistep.tools.blobs import data

    x, y = data(0)

    def loss_fn():
        return _xent(_dense(tf.constant(x), 2, "dense"), y)
    return loss_fn


MODELS = {"mlp": mlp, "autoencoder": autoencoder, "lstm": lstm, "bn_mlp": bn_mlp,
          "convnet": convnet, "blobs": blobs}


def _single_step(loss_fn):
    loss = loss_fn()
    with tf.control_dependencies(V1.get_collection(V1.GraphKeys.UPDATE_OPS)):
        train = V1.train.AdamOptimizer(1e-3).minimize(loss)
    return loss, train


def build(method, model, steps):
    """(graph, the fetch one call runs, steps a call, what mode ran)."""
    graph = tf.Graph()
    with graph.as_default():
        loss_fn = MODELS[model]()
        if method == "empty call":
            fetch, calls, mode = [tf.constant(0.0), tf.no_op()], steps, "no kernels"
        elif method == "single":
            loss, train = _single_step(loss_fn)
            fetch, calls, mode = [loss, train], steps, "single"
        elif method.startswith("ms.unroll"):
            mode = {"ms.unroll auto": "auto", "ms.unroll loop": "while_loop",
                    "ms.unroll loop+xla": "while_loop"}.get(method, "unrolled")
            fused = ms.unroll(loss_fn, V1.train.AdamOptimizer(1e-3), steps, mode=mode,
                              xla=method.endswith("+xla"))
            fetch, calls, mode = fused.losses, 1, fused.mode
        else:
            mode = method.split()[1]
            mode = "while_loop" if mode == "loop" else mode
            fused = ms.compile(list(_single_step(loss_fn)), steps, mode=mode)
            fetch, calls = fused.values, 1
        init = [V1.global_variables_initializer(), V1.local_variables_initializer()]
    return graph, init, fetch, calls, mode


METHODS = ("single", "ms.unroll auto", "ms.unroll", "ms.unroll loop", "ms.unroll loop+xla",
           "compile loop", "compile unrolled", "empty call")
# What mode="auto" chooses among (unrolled up to N = 64): its choice against the fastest.
AUTO_CHOICES = ("ms.unroll", "ms.unroll loop", "ms.unroll loop+xla")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--steps", nargs="+", type=int, default=[4, 16, 64])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3, help="per method per round")
    args = parser.parse_args()
    print(f"{'model':12} {'N':>3}  " + "  ".join(f"{m:>18}" for m in args.methods)
          + "   single / best fused (mode)")
    for model in args.models:
        for steps in args.steps:
            runners, modes, built = {}, {}, {}
            for method in args.methods:
                started = time.perf_counter()
                graph, init, fetch, calls, modes[method] = build(method, model, steps)
                built[method] = time.perf_counter() - started
                sess = V1.Session(graph=graph)
                sess.run(init)
                call = sess.make_callable(fetch)
                call()  # warm-up (and XLA's compile)
                runners[method] = (sess, call, calls)
            samples = {m: [] for m in args.methods}
            for _ in range(args.rounds):  # interleaved: a slow moment hits every method
                for method, (sess, call, calls) in runners.items():
                    start, done = time.perf_counter(), 0
                    while done == 0 or time.perf_counter() - start < args.seconds:
                        for _ in range(calls):
                            call()
                        done += 1
                    samples[method].append((time.perf_counter() - start) / (done * steps) * 1e6)
            for sess, _, _ in runners.values():
                sess.close()
            us = {m: statistics.median(v) for m, v in samples.items()}
            fused = [m for m in args.methods if m not in ("single", "empty call")]
            best = min(fused, key=us.get) if fused else None
            ratio = (f"   {us['single'] / us[best]:.2f}x ({best}: {modes[best]})"
                     if best and "single" in us else "")
            if "single" in us and "compile loop" in us:  # ms.compile's default, paired
                paired = statistics.median(
                    s / c for s, c in zip(samples["single"], samples["compile loop"]))
                ratio += f"; compile loop {paired:.2f}x paired"
            if "single" in us and "ms.unroll auto" in us:  # round by round: the pairs ran
                paired = statistics.median(  # back to back, so the machine's drift cancels
                    s / a for s, a in zip(samples["single"], samples["ms.unroll auto"]))
                ratio += f"; auto ({modes['ms.unroll auto']}) {paired:.2f}x paired"
            choices = [m for m in AUTO_CHOICES if m in us]
            if "ms.unroll auto" in us and choices:  # auto against the fastest it could build
                fastest = min(choices, key=us.get)
                paired = statistics.median(
                    a / f for a, f in zip(samples["ms.unroll auto"], samples[fastest]))
                chose = {"auto": None, "unrolled": "ms.unroll", "while_loop": "ms.unroll loop",
                         "while_loop+xla": "ms.unroll loop+xla"}.get(modes["ms.unroll auto"])
                ratio += (f"; auto / fastest mode ({fastest}) {paired:.3f} paired; auto's build "
                          f"{built['ms.unroll auto']:.1f} s"
                          + (f" against {built[chose]:.1f} s for its mode" if chose in built
                             else ""))
            if "single" in us and "empty call" in us:
                most = us["single"] / (us["single"] - us["empty call"] * (1 - 1 / steps))
                ratio += f"; the calls alone: {most:.3f}x"
            print(f"{model:12} {steps:>3}  " + "  ".join(f"{us[m]:>16.1f}µs" for m in args.methods)
                  + ratio, flush=True)


if __name__ == "__main__":
    main()
