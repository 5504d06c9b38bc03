"""Keras 3 fit(steps_per_execution=N), and every inner step's loss at its true step.

Keras calls the callbacks once per execution of N steps, with the last step's logs;
ms.keras.StepHistory keeps each inner step's, and writes one TensorBoard point per step.

    python examples/keras_step_history.py [--logdir tensorboard_logs/keras_step_history]
"""

import argparse

import keras
from sklearn.datasets import make_blobs

import multistep as ms

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--logdir", default="tensorboard_logs/keras_step_history")
args = parser.parse_args()

x, y = make_blobs(n_samples=96, centers=3, n_features=4, random_state=0)
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3)])
model.compile(optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              steps_per_execution=6)  # 6 steps per call of the compiled train function

steps = ms.keras.StepHistory(log_dir=args.logdir)
model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[steps])
print(f"{len(steps.steps)} steps in {len(steps.steps) // 6} executions; per-step loss:")
for step, loss in zip(steps.steps, steps.history["loss"]):
    print(f"  step {step:>2}  loss {loss:.4f}")
print(f"TensorBoard: a point per step under {args.logdir}")
