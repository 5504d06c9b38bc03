"""The toy problem: a dense 2->2 softmax classifier on scikit-learn's ``make_blobs``.

Used by ``multistep blobs``, the examples and the benchmarks.
"""

import numpy as np
import tensorflow as tf
from sklearn.datasets import make_blobs

from multistep import rules
from multistep.choices import OPTIMIZERS
from multistep.unroll import unroll

__all__ = ["OPTIMIZERS", "build", "data", "make_optimizer", "predict"]


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


def build(steps, *, optimizer="sgd", lr=0.01, seed=0, grad_transforms=(), modulus=None,
          mode="unrolled"):
    """``build_fn`` for ``ms.verify``: the blobs classifier with ``steps`` inner steps.

    The dense layer's kernel starts at ones and its bias at zeros; the loss is
    the mean softmax cross-entropy over all 50 points (full batch).
    ``optimizer="compact-sgd"`` trains with ``ms.rules.compact_sgd(modulus)``.
    """
    x, y = data(seed)

    def loss_fn():
        kernel = tf.compat.v1.get_variable(
            "dense/kernel", [2, 2], initializer=tf.compat.v1.ones_initializer())
        bias = tf.compat.v1.get_variable(
            "dense/bias", [2], initializer=tf.compat.v1.zeros_initializer())
        logits = tf.matmul(x, kernel) + bias
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

    global_step = tf.compat.v1.train.get_or_create_global_step()
    if optimizer == "compact-sgd":
        opt = rules.RuleOptimizer(rules.compact_sgd(modulus), learning_rate=lr)
    else:
        opt = make_optimizer(optimizer, lr)
    return unroll(loss_fn, opt, steps, global_step=global_step, grad_transforms=grad_transforms,
                  mode=mode), {}


def predict(values, x):
    """Class predictions of the trained layer, from the variable values ``ms.verify`` reports."""
    return np.argmax(x @ values["dense/kernel"] + values["dense/bias"], axis=1)
