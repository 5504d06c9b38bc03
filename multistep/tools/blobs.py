"""The toy problem: a dense 2->2 softmax classifier on scikit-learn's ``make_blobs``.

Used by ``multistep blobs``, the examples and the benchmarks.
"""

import dataclasses
import functools
import statistics

import numpy as np
import tensorflow as tf
from sklearn.datasets import make_blobs

from multistep.builder import rules
from multistep.choices import OPTIMIZERS
from multistep.builder.unroll import unroll

__all__ = ["OPTIMIZERS", "Speed", "build", "data", "logical_cpus", "make_optimizer", "predict",
           "seed_step", "speed"]


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


def _optimizer(optimizer, lr, modulus):
    if optimizer == "compact-sgd":
        return rules.RuleOptimizer(rules.compact_sgd(modulus), learning_rate=lr)
    return make_optimizer(optimizer, lr)


def _layer():
    kernel = tf.compat.v1.get_variable(
        "dense/kernel", [2, 2], initializer=tf.compat.v1.ones_initializer())
    bias = tf.compat.v1.get_variable("dense/bias", [2], initializer=tf.compat.v1.zeros_initializer())
    return kernel, bias


def _loss(x, y, kernel, bias):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(x, kernel) + bias))


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
    opt = _optimizer(optimizer, lr, modulus)
    if replicas > 1:
        return _build_replicated(steps, x, y, opt, replicas, grad_transforms, mode), {}

    def loss_fn():
        return _loss(x, y, *_layer())

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


def seed_step(*, optimizer="sgd", lr=0.01, grad_transforms=(), modulus=None):
    """The single step as a TF1 program is written before multistep: the points fed
    through placeholders, ``compute_gradients``, the transforms, ``apply_gradients``.
    Returns (fetches ``[loss, train_op]``, the x and y placeholders)."""
    from multistep.builder import transforms

    x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    loss = _loss(x, y, *_layer())
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = _optimizer(optimizer, lr, modulus)
    grads_and_vars = opt.compute_gradients(loss)
    for transform in grad_transforms:
        grads_and_vars = transforms.apply_transform(transform, grads_and_vars,
                                                    global_step.read_value())
    return [loss, opt.apply_gradients(grads_and_vars, global_step=global_step)], x, y


@dataclasses.dataclass(frozen=True)
class Speed:
    """``speed``'s figures: µs a step of the fused run, of N ``sess.run`` calls with a
    feed dict and of N ``make_callable`` calls; the medians of the paired ratios."""
    fused_us: float
    sess_run_us: float
    callable_us: float
    over_sess_run: float
    over_callable: float
    rounds: int


def speed(build_fn, steps, *, seed=0, rounds=7, block_seconds=0.02, **options):
    """Times a step of ``build_fn(steps)``'s run against ``steps`` single steps of
    ``seed_step(**options)`` run as a seed program runs them: ``sess.run([loss,
    train_op], feed_dict)`` and ``make_callable``. Each program in its own graph and
    session; ``rounds`` interleaved rounds (the order rotated), each program's turn as
    many runs as fill ``block_seconds``; the ratios paired round by round. A ``Speed``."""
    from multistep.tools import bench_step

    x_data, y_data = data(seed)
    calls, sessions = [], []
    try:
        with tf.Graph().as_default() as graph:
            fused = build_fn(steps)[0]
            init = tf.compat.v1.global_variables_initializer()
        sessions.append(tf.compat.v1.Session(graph=graph))
        sessions[-1].run(init)
        calls.append(lambda s=sessions[-1]: fused.run(s))
        with tf.Graph().as_default() as graph:
            fetches, x, y = seed_step(**options)
            init = tf.compat.v1.global_variables_initializer()
        for kind in ("sess.run", "make_callable"):
            session = tf.compat.v1.Session(graph=graph)
            sessions.append(session)
            session.run(init)
            if kind == "sess.run":
                def one(s=session):
                    s.run(fetches, feed_dict={x: x_data, y: y_data})
            else:
                one = session.make_callable(fetches, feed_list=[x, y])
                one = functools.partial(one, x_data, y_data)

            def run_steps(one=one):
                for _ in range(steps):
                    one()
            calls.append(run_steps)
        times = bench_step.paired_rounds(calls, rounds, block_seconds)
    finally:
        for session in sessions:
            session.close()
    per_step = [[t / steps * 1e6 for t in runs] for runs in times]
    medians = [statistics.median(t) for t in per_step]
    ratios = [statistics.median(b / a for a, b in zip(per_step[0], per_step[i]))
              for i in (1, 2)]
    return Speed(*medians, *ratios, rounds)
