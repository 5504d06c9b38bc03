"""A GAN, two optimizers a step, fused: ``ms.unroll`` with a phase each.

The classic TF1 GAN step trains the discriminator, then the generator on fresh reads
of the discriminator (``g_train`` built under ``control_dependencies([d_train])``),
one ``sess.run`` per step. Two ``ms.unroll`` train ops fetched together would be two
chains of steps that nothing orders against each other (``ms.unroll`` warns); one
``ms.unroll([ms.phase(...), ms.phase(...)], steps=N)`` runs both phases in every inner
step, in order. Both the chained and the simultaneous step (both gradients from the
same reads, then both applies) are checked here against the canonical single steps.

    python examples/gan.py
"""

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
BATCH, NOISE, STEPS, RUNS = 32, 4, 5, 4
rng = np.random.RandomState(0)
REAL = (rng.randn(STEPS * RUNS, BATCH, 2) * [0.5, 2.0] + [1.0, -1.0]).astype(np.float32)
Z = rng.randn(STEPS * RUNS, BATCH, NOISE).astype(np.float32)


def dense(name, x, units, activation=None):
    with V1.variable_scope(name, reuse=V1.AUTO_REUSE):  # the discriminator is called twice
        seed = sum(map(ord, name))
        w = V1.get_variable("w", initializer=np.random.RandomState(seed).randn(
            int(x.shape[-1]), units).astype(np.float32) * 0.3)
        b = V1.get_variable("b", initializer=np.zeros(units, np.float32))
        h = tf.matmul(x, w) + b
        return activation(h) if activation else h


def generator(z):
    with V1.variable_scope("generator"):
        return dense("out", dense("hidden", z, 16, tf.nn.relu), 2)


def discriminator(x):
    with V1.variable_scope("discriminator"):
        return dense("out", dense("hidden", x, 16, tf.nn.relu), 1)


def xent(logits, label):
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.fill(tf.shape(logits), label), logits=logits))


def d_loss(real, z):
    return xent(discriminator(real), 1.0) + xent(discriminator(generator(z)), 0.0)


def g_loss(real, z):
    return xent(discriminator(generator(z)), 1.0)


def scoped(prefix):
    return [v for v in V1.trainable_variables() if v.op.name.startswith(prefix)]


def values(sess):
    return {v.op.name: sess.run(v) for v in V1.global_variables()}


def single_steps(order):
    """The canonical single step, one sess.run each."""
    with tf.Graph().as_default():
        real, z = V1.placeholder(tf.float32, [BATCH, 2]), V1.placeholder(tf.float32, [BATCH, NOISE])
        gs = V1.train.get_or_create_global_step()
        d_opt, g_opt = V1.train.AdamOptimizer(2e-3, 0.5), V1.train.AdamOptimizer(2e-3, 0.5)
        d = d_loss(real, z)
        if order == "chained":  # the generator's loss read after the discriminator's apply
            d_train = d_opt.minimize(d, var_list=scoped("discriminator"))
            with tf.control_dependencies([d_train]):
                g = g_loss(real, z)
                train = g_opt.minimize(g, var_list=scoped("generator"), global_step=gs)
        else:  # both gradients from the same reads, then both applies
            g = g_loss(real, z)
            d_grads = d_opt.compute_gradients(d, var_list=scoped("discriminator"))
            g_grads = g_opt.compute_gradients(g, var_list=scoped("generator"))
            with tf.control_dependencies([d, g] + [t for t, _ in d_grads + g_grads]):
                train = tf.group(d_opt.apply_gradients(d_grads),
                                 g_opt.apply_gradients(g_grads, global_step=gs))
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            losses = [sess.run([train, d, g], {real: REAL[k], z: Z[k]})[1:]
                      for k in range(STEPS * RUNS)]
            return values(sess), np.array(losses, np.float32)


def fused(order, mode="unrolled"):
    with tf.Graph().as_default():
        real = V1.placeholder(tf.float32, [STEPS, BATCH, 2])
        z = V1.placeholder(tf.float32, [STEPS, BATCH, NOISE])
        gs = V1.train.get_or_create_global_step()
        d_opt, g_opt = V1.train.AdamOptimizer(2e-3, 0.5), V1.train.AdamOptimizer(2e-3, 0.5)
        unrolled = ms.unroll(
            [ms.phase(d_loss, d_opt, var_list=lambda: scoped("discriminator"), name="d"),
             ms.phase(g_loss, g_opt, var_list=lambda: scoped("generator"), name="g")],
            steps=STEPS, inputs=(real, z), global_step=gs, phases=order, mode=mode)
        fetch = [unrolled.train_op, unrolled.records["loss/d"], unrolled.records["loss/g"]]
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            losses = []
            for r in range(RUNS):
                batch = slice(r * STEPS, (r + 1) * STEPS)
                _, d, g = sess.run(fetch, {real: REAL[batch], z: Z[batch]})
                losses.extend(zip(d, g))
            return values(sess), np.array(losses, np.float32)


if __name__ == "__main__":
    for order in ("chained", "simultaneous"):
        (want, want_losses), (got, got_losses) = single_steps(order), fused(order)
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        diff = max(float(np.max(np.abs(got[n] - want[n]))) for n in want)
        diff = max(diff, float(np.max(np.abs(got_losses - want_losses))))
        bitwise = all(got[n].tobytes() == want[n].tobytes() for n in want) and \
            got_losses.tobytes() == want_losses.tobytes()
        print(f"{order}: {STEPS * RUNS} steps of D then G ({RUNS} runs of {STEPS}) against "
              f"single steps: max |Δ| = {diff:g}{' (bitwise equal)' if bitwise else ''}; "
              f"last losses D {got_losses[-1, 0]:.4f}, G {got_losses[-1, 1]:.4f}")
        if not bitwise:
            raise SystemExit(1)
