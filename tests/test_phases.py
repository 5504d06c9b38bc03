"""Several phases per inner step (ms.phase): a GAN's discriminator then generator, against
the canonical single steps written in examples/gan.py (chained: g_train built under
control_dependencies([d_train]); simultaneous: both gradients, then both applies), in
both modes; two ms.unroll train ops over the same state warned about; bad arguments."""

import importlib.util
import pathlib
import warnings

import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
_spec = importlib.util.spec_from_file_location(
    "gan", pathlib.Path(__file__).parents[1] / "examples" / "gan.py")
gan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gan)


@pytest.mark.parametrize("order", ["chained", "simultaneous"])
def test_gan_phases_in_a_loop_are_bitwise_with_single_steps(order):
    (want, want_losses), (got, got_losses) = gan.single_steps(order), gan.fused(order, "while_loop")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    assert got_losses.tobytes() == want_losses.tobytes()
    assert want["global_step"] == gan.STEPS * gan.RUNS


def test_the_two_orders_differ():
    """The reference tells them apart (else the simultaneous test would prove nothing)."""
    chained, simultaneous = gan.single_steps("chained")[0], gan.single_steps("simultaneous")[0]
    assert chained["generator/out/w"].tobytes() != simultaneous["generator/out/w"].tobytes()


def test_two_unrolled_train_ops_over_shared_state_are_warned_about():
    """Fetched in one sess.run, a D and a G ms.unroll are two unordered chains (a race)."""
    with tf.Graph().as_default():
        z = tf.constant(gan.Z[:2])
        real = tf.constant(gan.REAL[:2])
        gan.d_loss(real[0], z[0])  # the variables, so that each ms.unroll gets its var_list
        d = ms.unroll(gan.d_loss, V1.train.AdamOptimizer(2e-3), 2, inputs=(real, z),
                      var_list=gan.scoped("discriminator"), name="d")
        with pytest.warns(RuntimeWarning, match=r"g and d \(built before it in this graph\) touch "
                                                r"the same state.*ms.phase"):
            ms.unroll(gan.g_loss, V1.train.AdamOptimizer(2e-3), 2, inputs=(real, z),
                      var_list=gan.scoped("generator"), name="g")
        assert d.train_op is not None


def test_simultaneous_phases_training_one_variable_warn_and_apply_in_phase_order():
    """Issue 28: both phases train 'w'; a single step applying both after both gradients
    leaves the two applies unordered. Warned, naming it; applied in phase order, bitwise
    with the single step that orders them so (the second apply after the first)."""
    def program(fused):
        w = V1.get_variable("w", initializer=[1.0, -2.0])
        v = V1.get_variable("v", initializer=[0.5, 0.25])
        one, two = (lambda: tf.reduce_sum(w * w * v)), (lambda: tf.reduce_sum(tf.sin(w) + v * v))
        opt_one, opt_two = V1.train.AdamOptimizer(0.1), V1.train.GradientDescentOptimizer(0.3)
        if fused:
            with pytest.warns(RuntimeWarning, match=r"phase 'two' and an earlier phase both "
                                                    r"train 'w'.*phase order"):
                return ms.unroll([ms.phase(one, opt_one, var_list=[w, v], name="one"),
                                  ms.phase(two, opt_two, var_list=[w], name="two")], steps=3,
                                 phases="simultaneous").train_op
        grads_one = opt_one.compute_gradients(one(), var_list=[w, v])
        grads_two = opt_two.compute_gradients(two(), var_list=[w])
        with tf.control_dependencies([g for g, _ in grads_one + grads_two]):
            first = opt_one.apply_gradients(grads_one)
        with tf.control_dependencies([first]):
            return opt_two.apply_gradients(grads_two)

    got = {}
    for fused in (True, False):
        with tf.Graph().as_default(), V1.Session() as sess:
            train = program(fused)
            sess.run(V1.global_variables_initializer())
            for _ in range(1 if fused else 3):
                sess.run(train)
            got[fused] = {x.op.name: sess.run(x) for x in V1.global_variables()}
    assert sorted(got[True]) == sorted(got[False])
    assert all(got[True][n].tobytes() == got[False][n].tobytes() for n in got[False])


def test_phases_of_disjoint_models_do_not_warn():
    with tf.Graph().as_default(), warnings.catch_warnings():
        warnings.simplefilter("error")
        a = V1.get_variable("a", initializer=1.0)
        b = V1.get_variable("b", initializer=1.0)
        ms.unroll(lambda: a * a, V1.train.GradientDescentOptimizer(0.1), 2, name="one")
        ms.unroll(lambda: b * b, V1.train.GradientDescentOptimizer(0.1), 2, name="two")


def test_verify_with_xla_on_phases_is_refused_not_a_false_divergence():
    """verify(xla=True) forces xla=True on every ms.unroll: a phases build now refuses it
    (before, the phases check read xla before the override: built without XLA and compared
    with XLA single steps, a false DIVERGED)."""
    def build(steps):
        w = V1.get_variable("w", initializer=1.0)
        sgd = V1.train.GradientDescentOptimizer(0.1)
        return ms.unroll([ms.phase(lambda: w * w, sgd)], steps=steps), {}

    with pytest.raises(ValueError, match="several phases build .* without XLA"):
        ms.verify(build, steps=2, runs=1, xla=True)


def test_bad_phases():
    sgd = V1.train.GradientDescentOptimizer(0.1)
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=1.0)
        one = ms.phase(lambda: w * w, sgd)
        with pytest.raises(TypeError, match="each ms.phase"):
            ms.unroll([one], sgd, 2)
        with pytest.raises(ValueError, match="phases must be one of"):
            ms.unroll([one], steps=2, phases="interleaved")
        with pytest.raises(ValueError, match="needs a list of ms.phase"):
            ms.unroll(lambda: w * w, sgd, 2, phases="simultaneous")
        with pytest.raises(ValueError, match="names must differ"):
            ms.unroll([ms.phase(lambda: w, sgd, name="x"), ms.phase(lambda: w, sgd, name="x")], steps=2)
        with pytest.raises(ValueError, match="without XLA"):
            ms.unroll([one], steps=2, xla=True)
        with pytest.raises(TypeError, match="loss_fn must be callable"):
            ms.phase(w, sgd)
        # Issue 28: a var_list callable returning None was "'NoneType' object is not iterable".
        with pytest.raises(TypeError, match=r"var_list\(\) must return a non-empty list of "
                                            r"variables, got None"):
            ms.unroll([ms.phase(lambda: w * w, sgd, var_list=lambda: None)], steps=2, name="n")
