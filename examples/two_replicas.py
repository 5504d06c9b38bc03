"""N fused steps on two replicas: MirroredStrategy over two logical CPUs.

Each inner step all-reduces the replicas' gradients through the optimizer's own
``merge_call``; one ``sess.run`` makes N synchronous distributed steps, checked
by ``ms.verify`` against N runs of one distributed step.

    python examples/two_replicas.py
"""

import numpy as np
import tensorflow as tf

# Two logical CPU devices; must be set before TensorFlow makes its first session.
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import multistep as ms  # noqa: E402

tf.get_logger().setLevel("ERROR")  # TF1 deprecation notices of the v1 distribute API

V1 = tf.compat.v1
STEPS, RUNS, GLOBAL_BATCH = 5, 4, 16
rng = np.random.RandomState(0)
X = rng.randn(GLOBAL_BATCH * STEPS * RUNS, 4).astype(np.float32)
Y = (X @ rng.randn(4, 2)).astype(np.float32)


def build(steps):
    """build_fn for ms.verify: the strategy, the mirrored weights and the per-replica
    batches are made in the fresh graph verify gives it."""
    strategy = V1.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w = V1.get_variable("w", initializer=np.zeros((4, 2), np.float32))
        global_step = V1.train.get_or_create_global_step()
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
    iterator = strategy.make_dataset_iterator(data)  # each replica gets half of each batch

    def loss_fn(x, y):  # scaled by the global batch: the all-reduce sums the replicas' parts
        return tf.reduce_sum(tf.square(x @ w - y)) / GLOBAL_BATCH

    return ms.distribute.unroll(strategy, loss_fn, V1.train.AdamOptimizer(0.1), steps,
                                inputs=iterator, global_step=global_step), {}


report = ms.verify(build, steps=STEPS, runs=RUNS)
print(f"2 replicas, {RUNS} runs of {STEPS} fused steps beside {STEPS * RUNS} single distributed steps")
print("losses (mean over the replicas), fused:", np.round(report.fused_losses[::STEPS], 5), "...")
print(report.summary())
