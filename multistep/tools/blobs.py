"""The toy problem: a dense 2->2 softmax classifier on scikit-learn's ``make_blobs``.

Used by ``multistep blobs``, the examples and the benchmarks.
"""

import numpy as np
import tensorflow as tf
from sklearn.datasets import make_blobs

from multistep.builder import rules
from multistep.choices import OPTIMIZERS
from multistep.builder.unroll import unroll

__all__ = ["OPTIMIZERS", "build", "data", "logical_cpus", "make_optimizer", "predict"]


def make_optimizer(name, learning_rate):
    """A stock ``tf.compat.v1.train`` optimizer by its short name (see ``OPTIMIZERS``)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}.")
    cls, options = OPTIMIZERS[name]
    return getattr(tf.compat.v1.train, cls)(learning_rate, **options)


def data(seed=0, n_samples=50):
    """``make_blobs(n_samples, centers=2, n_features=2, random_state=seed)`` as float32/int32."""
    x, y = make_blobs(n_samples=n_samples, centers=2, n_features=2, random_state=seed)
    return x.astype(np.float32), y.astype(np.int32)


def logical_cpus(n):
    """Splits this process's CPU into ``n`` logical devices, ``/cpu:0`` .. ``/cpu:{n-1}``,
    for ``build(..., replicas=n)``. Must run before TensorFlow makes its first session."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)


def build(steps, *, optimizer="sgd", lr=0.01, seed=0, grad_transforms=(), modulus=None,
          mode="unrolled", replicas=1):
    """``build_fn`` for ``ms.verify``: the blobs classifier with ``steps`` inner steps.

    The dense layer's kernel starts at ones and its bias at zeros; the loss is
    the mean softmax cross-entropy over all 50 points (full batch).
    ``optimizer="compact-sgd"`` trains with ``ms.rules.compact_sgd(modulus)``.

    ``replicas=R > 1``: under ``MirroredStrategy`` over ``/cpu:0`` .. ``/cpu:{R-1}``
    (``logical_cpus(R)`` first): replica r takes its share of the 50 points, its loss
    is its points' cross-entropy summed and divided by 50, so the all-reduce (a sum)
    of the replicas' gradients is the full batch's gradient, and the ``losses``
    (summed over the replicas) the full batch's loss.
    """
    x, y = data(seed)
    if optimizer == "compact-sgd":
        opt = rules.RuleOptimizer(rules.compact_sgd(modulus), learning_rate=lr)
    else:
        opt = make_optimizer(optimizer, lr)
    if replicas > 1:
        return _build_replicated(steps, x, y, opt, replicas, grad_transforms, mode), {}

    def loss_fn():
        kernel = tf.compat.v1.get_variable(
            "dense/kernel", [2, 2], initializer=tf.compat.v1.ones_initializer())
        bias = tf.compat.v1.get_variable(
            "dense/bias", [2], initializer=tf.compat.v1.zeros_initializer())
        logits = tf.matmul(x, kernel) + bias
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

    global_step = tf.compat.v1.train.get_or_create_global_step()
    return unroll(loss_fn, opt, steps, global_step=global_step, grad_transforms=grad_transforms,
                  mode=mode), {}


def _build_replicated(steps, x, y, opt, replicas, grad_transforms, mode):
    from multistep.loops import distribute

    strategy = tf.compat.v1.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        kernel = tf.compat.v1.get_variable(
            "dense/kernel", [2, 2], initializer=tf.compat.v1.ones_initializer())
        bias = tf.compat.v1.get_variable(
            "dense/bias", [2], initializer=tf.compat.v1.zeros_initializer())
        global_step = tf.compat.v1.train.get_or_create_global_step()
    bounds = np.linspace(0, len(x), replicas + 1).astype(int)  # replica r: rows bounds[r]:bounds[r+1]
    starts, sizes = tf.constant(bounds[:-1]), tf.constant(np.diff(bounds))

    def loss_fn():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        mine = tf.range(starts[r], starts[r] + sizes[r])
        logits = tf.matmul(tf.gather(x, mine), kernel) + bias
        return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.gather(y, mine), logits=logits)) / len(x)

    return distribute.unroll(strategy, loss_fn, opt, steps, reduce="sum", global_step=global_step,
                             grad_transforms=grad_transforms, mode=mode)


def predict(values, x):
    """Class predictions of the trained layer, from the variable values ``ms.verify`` reports."""
    return np.argmax(x @ values["dense/kernel"] + values["dense/bias"], axis=1)
