"""TensorFlow 2 and Keras 3: N training steps in one tf.function call, every step's loss
kept, checked for the stale-value trap, and verified bitwise against N single calls.

    python examples/tf2_fuse.py [--steps N] [--calls C]
"""

import argparse

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import make_blobs

import multistep as ms

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=10, help="steps per call (N)")
parser.add_argument("--calls", type=int, default=3)
args = parser.parse_args()

x, y = make_blobs(n_samples=64, centers=3, n_features=4, random_state=0)
x, y = x.astype(np.float32), y.astype(np.int32)
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dense(3)])
optimizer = keras.optimizers.Adam(1e-2)
xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_step(batch):  # one step, exactly as for @tf.function
    features, labels = batch
    with tf.GradientTape() as tape:
        loss = xent(labels, model(features, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return {"loss": loss, "grad_norm": tf.linalg.global_norm(grads)}


# Each step takes a batch of 16 points: N steps' batches stacked on a leading axis.
rng = np.random.RandomState(1)
picks = rng.randint(0, len(x), size=(args.steps * args.calls, 16))
batches = (x[picks], y[picks])

fused = ms.tf2.fuse(train_step, steps=args.steps)
findings = ms.tf2.check(fused, (batches[0][:args.steps], batches[1][:args.steps]))
print("check:", "no trap found" if not findings else "\n".join(map(str, findings)))

report = ms.tf2.verify(train_step, args.steps, batches=batches, calls=args.calls)
print(report.summary())  # verify restores the model: training starts from the same point

for call in range(args.calls):
    block = slice(call * args.steps, (call + 1) * args.steps)
    out = fused((batches[0][block], batches[1][block]))  # N steps, one call
    print(f"call {call + 1}: steps {out['iteration'].numpy()[0]}-{out['iteration'].numpy()[-1]}, "
          f"losses {np.round(out['loss'].numpy(), 3)}")
