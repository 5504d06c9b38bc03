"""`ms.tf2.fuse` with and without `jit_compile` on a small conv autoencoder (Keras 3).

The model: Conv2D(16, 3, stride 2, relu) then Conv2DTranspose(3, 3, stride 2) over
16x16x3 images, batch 32, MSE against the input, Adam. Both fused runs take the same N
batches; they are timed round by round in one process (µs per step, median of the
rounds). What `fuse(jit_compile=True)`'s warning about convolutions on the CPU cites.

    taskset -c 0 python benchmarks/tf2_conv.py [--steps 16] [--rounds 7]
"""

import argparse
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

import multistep as ms


def conv_step():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same")])
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - x))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    batches = tf.constant(np.random.RandomState(0).randn(
        args.steps, 32, 16, 16, 3).astype(np.float32))
    fused = {"fuse": ms.tf2.fuse(conv_step(), args.steps),
             "fuse+jit": ms.tf2.fuse(conv_step(), args.steps, jit_compile=True)}
    for f in fused.values():  # trace and compile
        f(batches)["loss"].numpy()
    times = {name: [] for name in fused}
    for _ in range(args.rounds):
        for name, f in fused.items():
            start = time.perf_counter()
            f(batches)["loss"].numpy()
            times[name].append((time.perf_counter() - start) / args.steps * 1e6)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:9s} N={args.steps}: {median:8.1f} µs a step")
    print(f"jit / no jit: {medians['fuse+jit'] / medians['fuse']:.2f}x the time")


if __name__ == "__main__":
    main()
