"""The promise under both TF1 preambles, both variable kinds, both control-flow modes and
oneDNN on and off: fused steps bitwise the canonical single steps, and every inner step
executing a single step's kernels (tests/preamble_cases.py, one subprocess per preamble
and oneDNN setting: all three are process-global).

oneDNN is set explicitly both ways (TF_ENABLE_ONEDNN_OPTS=1 and 0): TensorFlow turns it on
by default only on CPUs with AVX-512 VNNI, BF16 or AMX, so the default differs between x86
machines. With it on, Grappler's remapper fuses MatMul + Add/BiasAdd + activation and
Conv2D + BiasAdd + Relu into _MklNativeFused* kernels; with it off, MatMul/Conv2D + BiasAdd
+ activation into _Fused* kernels. A step whose ops reach Grappler in another shape than a
single step's runs other kernels, which round differently on some CPU even where this one
happens to agree: so the kernels are asserted, not only the values.
"""

import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("preamble_cases.py")
OPTIMIZERS = ["Adam", "RMSProp", "Momentum", "SGD"]
MODELS = ["mlp", "conv", "batch_norm"]
# A fused kernel each model must run, or the test would not test the rewrite it is meant
# to: with oneDNN, the MatMul + Add + Tanh (its "+ b1" is an AddV2, which only
# oneDNN's remapper fuses); without, MatMul + BiasAdd + Relu.
HITS = {("mlp", "1"): "_MklNativeFusedMatMul(BiasAdd, Tanh)",
        ("mlp", "0"): "_FusedMatMul(BiasAdd, Relu)",
        ("conv", "1"): "_MklNativeFusedConv2D(BiasAdd, Relu)",
        ("conv", "0"): "_FusedConv2D(BiasAdd, Relu)",
        ("batch_norm", "1"): "_MklNativeFusedBatchNormEx", ("batch_norm", "0"): "FusedBatchNormV3"}


def cases(preamble):
    """Every model under each variable kind and mode that the preamble allows, the four
    optimizers taken in turn (each model meets each); under disable_v2_behavior also the
    issue's ref-variable MLP with RMSProp, Adam and SGD in both modes, loop-mode runs
    shortened by set_steps_per_run, and nonfinite="skip" (a v1 tf.cond over ref variables). Ref variables in loop mode need v1 control flow:
    under disable_eager_execution alone they are refused (test_modes)."""
    combos = [(m, k, mode) for m, k, mode in itertools.product(
        MODELS, ["resource", "ref"], ["unrolled", "while_loop"])
        if not (preamble == "disable_eager_execution" and k == "ref" and mode == "while_loop")]
    out = [f"{m}:{k}:{mode}:{OPTIMIZERS[i % 4]}" for i, (m, k, mode) in enumerate(combos)]
    if preamble == "disable_v2_behavior":
        out += [f"mlp:ref:{mode}:{opt}" for mode in ("unrolled", "while_loop")
                for opt in ("RMSProp", "Adam", "SGD")]
        out += ["mlp:ref:while_loop:Adam:short", "batch_norm:ref:while_loop:Momentum:short",
                "conv:ref:unrolled:Adam:skip", "mlp:ref:while_loop:RMSProp:skip"]
    # Conds on a fed `training` placeholder (batch norm's, and one whose branch reads a
    # weight) and one tf.compat.v1.layers.Dense shared by three time steps, unrolled (the
    # mode where step k's ops sit in one graph with step k-1's), both variable kinds.
    out += [f"{m}:{k}:unrolled:{opt}" for m, k, opt in [
        ("bn_placeholder", "resource", "Adam"), ("bn_placeholder", "ref", "Momentum"),
        ("cond_read", "resource", "RMSProp"), ("cond_read", "ref", "SGD"),
        ("shared_dense", "resource", "Adam"), ("shared_dense", "ref", "SGD")]]
    out += ["shared_dense:resource:while_loop:Adam"]
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("onednn", ["1", "0"])
@pytest.mark.parametrize("preamble", ["disable_eager_execution", "disable_v2_behavior"])
def test_bitwise_with_the_single_steps_kernels(preamble, onednn):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_USE_LEGACY_KERAS="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    want = cases(preamble)
    result = subprocess.run([sys.executable, str(WORKER), preamble, *want], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in rows] == want
    for row in rows:
        case = row["case"]
        assert row["max_delta"] == 0.0, (case, {k: v for k, v in row["deltas"].items() if v})
        assert row["kernel_difference"] is None, (case, row["kernel_difference"])
        # Structural: in the executed graph every read of step k descends from step k-1's
        # apply (a race may not show in the values of one run).
        assert row["unordered_reads"] == [], (case, row["unordered_reads"])
        loop = ":while_loop:" in case
        # Structural: the loop body's max pool gradients come after their pools in
        # oneDNN's visit order, whatever this process's hashing (preamble_cases.visit_order).
        grads, unordered = row["pool_grads"]
        assert unordered == [], (case, unordered)
        assert len(grads) == (case.startswith("conv:") and loop), (case, grads)
        assert row["steps"] == (["1..N"] if loop else ["1", "2", "3"]), case
        model = case.split(":")[0]
        if (model, onednn) in HITS:
            assert HITS[model, onednn] in row["ops"], (case, row["ops"])


XLA_OVER_REF = """
import numpy as np, tensorflow as tf
tf.compat.v1.disable_v2_behavior()
import multistep as ms
w = tf.compat.v1.get_variable("w", initializer=np.ones([2, 2], np.float32))
ms.unroll(lambda: tf.reduce_sum(w * w), tf.compat.v1.train.GradientDescentOptimizer(0.1), 3,
          xla=True, nonfinite="ignore")
"""


def test_xla_over_ref_variables_is_refused_with_the_reason():
    """XLA compiles only resource variables; before, TensorFlow's own error named an
    ApplyGradientDescent input's float32_ref type."""
    result = subprocess.run([sys.executable, "-c", XLA_OVER_REF], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 1
    assert ("TypeError: xla=True needs resources variables, but 'w' is a ref variable"
            .replace("resources", "resource") in result.stderr), result.stderr[-2000:]
    assert "enable_resource_variables()" in result.stderr


NEW_UNDER_V1 = """
import json, sys
import numpy as np, tensorflow as tf
tf.compat.v1.disable_v2_behavior()
sys.path[:0] = ["examples", "tests"]
import gan, test_carry as tc, test_sampling as tsa
import multistep as ms
V1 = tf.compat.v1
out = {}
# nce_loss over ref variables, its stateless sampler keyed on a ref global step read
# through tf.cast (which Grappler moves ahead of a snapshot Identity: the cast must keep
# its own order): bitwise with canonical single steps (the test raises otherwise).
for loss in ("nce", "softmax"):
    for mode in ("unrolled", "while_loop"):
        try:
            tsa.test_the_stateless_sampler_is_bitwise_with_canonical_single_steps(loss, mode)
            out[f"sampler:{loss}:{mode}"] = True
        except AssertionError as error:
            out[f"sampler:{loss}:{mode}"] = str(error)
for order in ("chained", "simultaneous"):
    for mode in ("unrolled", "while_loop"):
        (want, want_losses), (got, got_losses) = gan.single_steps(order), gan.fused(order, mode)
        out[f"gan:{order}:{mode}"] = (sorted(got) == sorted(want) and got_losses.tobytes() ==
                                      want_losses.tobytes() and all(
            got[n].tobytes() == want[n].tobytes() for n in want))
want, _, want_state = tc.feed_dict_original("ref", 12)
for mode in ("unrolled", "while_loop"):
    with tf.Graph().as_default():
        words = V1.placeholder(tf.int32, [3, tc.BATCH, tc.TIME + 1])
        state = tuple(V1.placeholder(tf.float32, [tc.BATCH, tc.HIDDEN]) for _ in range(2))
        u = ms.unroll(tc.language_model("ref"), V1.train.AdamOptimizer(0.02), 3, inputs=words,
                      carry=state, mode=mode)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            now = (np.zeros([tc.BATCH, tc.HIDDEN], np.float32),) * 2
            for r in range(4):
                _, now = sess.run([u.train_op, u.carry], {words: tc.WORDS[3 * r:3 * r + 3],
                                                          state[0]: now[0], state[1]: now[1]})
            got = {v.op.name: sess.run(v) for v in V1.global_variables()}
        out[f"carry:ref:{mode}"] = all(got[n].tobytes() == want[n].tobytes() for n in want) and all(
            a.tobytes() == b.tobytes() for a, b in zip(now, want_state))
print(json.dumps(out))
"""


def test_phases_carry_and_samplers_under_disable_v2_behavior():
    """The canonical TF1 preamble (ref variables, v1 control flow): the GAN's phases in
    both orders and modes, carried LSTM state over ref variables unrolled, and the
    word2vec models with the stateless sampler (reading a ref global step) in both
    modes, bitwise with their single steps; carried LSTM state in a v1 loop too (its
    gradients are the single step's, outside the loop)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", NEW_UNDER_V1], capture_output=True, text=True,
                            timeout=600, env=env, cwd=WORKER.parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {
        "gan:chained:unrolled": True, "gan:chained:while_loop": True,
        "gan:simultaneous:unrolled": True, "gan:simultaneous:while_loop": True,
        "carry:ref:unrolled": True, "carry:ref:while_loop": True,
        "sampler:nce:unrolled": True, "sampler:nce:while_loop": True,
        "sampler:softmax:unrolled": True, "sampler:softmax:while_loop": True}
