"""The command line, run as a user runs it: in a subprocess."""

import argparse
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def multistep(*args, cwd=ROOT):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "multistep", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_blobs_prints_the_side_by_side_table_and_verifies(tmp_path):
    logdir = tmp_path / "logs"
    result = multistep("blobs", "--steps", "2", "--runs", "3", "--logdir", str(logdir))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = re.findall(r"^\s+(\d+)\s+(?:►\s+(\d+))?\s+(\d\.\d{8})\s+(\d\.\d{8})\s+(\S+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r[1] for r in rows] == ["1", "", "2", "", "3", ""]  # where each 2-step run began
    assert all(r[2] == r[3] for r in rows)
    # ln 2: both logits equal at ones. The bound is the printed precision, 8 decimals (5e-9),
    # plus the float32 loss itself: log within 1 ulp (2u, u = 2^-24), then the mean of 50 equal
    # terms, a 50-term sum (49u) and a division (u): 52u * ln 2 = 2.1e-6 (the default rel=1e-6
    # was tighter than that allows: k * fl(ln 2) is not exact in float32 for every k <= 50).
    assert float(rows[0][2]) == pytest.approx(0.69314718, rel=0, abs=5e-9 + 52 * 2.0 ** -24 * 0.6931472)
    assert float(rows[-1][2]) < float(rows[0][2])
    assert "max |Δ| = 0 (bitwise equal)" in out and ": OK" in out
    assert re.search(r"accuracy after 6 steps: \d\.\d{3} \(\d+/50\)", out)
    assert os.listdir(logdir) and f"tensorboard --logdir {logdir}" in out


def test_blobs_with_another_optimizer(tmp_path):
    result = multistep("blobs", "--steps", "4", "--runs", "2", "--optimizer", "adam", "--lr", "0.1",
                       "--seed", "3", "--logdir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "AdamOptimizer(lr=0.1)" in result.stdout and "random_state=3" in result.stdout
    assert "(bitwise equal)" in result.stdout


@pytest.mark.parametrize("options,shown", [
    (["--clip-global-norm", "1", "--noise-stddev", "0.01"],
     "clip_by_global_norm(1); add_noise(0.01, mean=0, decay=0, seed=0)"),
    (["--clip-value", "0.05", "--clip-norm", "0.1", "--optimizer", "momentum"],
     "clip_by_value(-0.05, 0.05); clip_by_norm(0.1)"),
    (["--rule", "compact-sgd", "--modulus", "4", "--lr", "0.1"], "RuleOptimizer(compact_sgd(4), lr=0.1)"),
])
def test_blobs_with_transforms_and_rules_still_verifies(tmp_path, options, shown):
    result = multistep("blobs", "--steps", "3", "--runs", "2", "--logdir", str(tmp_path), *options)
    assert result.returncode == 0, result.stderr
    assert shown in result.stdout
    assert "max |Δ| = 0 (bitwise equal)" in result.stdout and ": OK" in result.stdout


def test_blobs_rule_needs_modulus():
    result = multistep("blobs", "--rule", "compact-sgd")
    assert result.returncode == 2 and "--modulus B go together" in result.stderr


def test_blobs_rejects_bad_steps():
    result = multistep("blobs", "--steps", "0")
    assert result.returncode == 2 and "expected an integer > 0, got '0'" in result.stderr


def test_verify_an_example_file():
    result = multistep("verify", "examples/verify_my_model.py:build", "--steps", "3", "--runs", "2")
    assert result.returncode == 0, result.stderr
    assert ": OK" in result.stdout and "hidden/w/Adam" in result.stdout


def test_verify_exits_1_on_divergence(tmp_path):
    model = tmp_path / "naive.py"
    model.write_text(textwrap.dedent("""
        import types
        import tensorflow as tf

        def build(steps):
            w = tf.compat.v1.get_variable("w", initializer=[1.0, -2.0])
            loss = tf.reduce_sum(tf.square(w))  # built once: stale from the second step on
            opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
            op = None
            for _ in range(steps):
                with tf.control_dependencies([op] if op is not None else []):
                    op = opt.minimize(loss)
            return types.SimpleNamespace(train_op=op, losses=tf.stack([loss] * steps)), {}
    """))
    result = multistep("verify", f"{model}:build", "--steps", "3", "--runs", "2")
    assert result.returncode == 1, result.stderr
    assert "DIVERGED" in result.stdout and "first divergence in run 1" in result.stdout


def test_verify_explain_prints_the_kernels():
    result = multistep("verify", "tests/test_verify.py:relu_layer_build", "--steps", "2",
                       "--runs", "1", "--explain")
    assert result.returncode == 0, result.stderr  # the values still agree on this model
    # (listed by name within the step)
    assert "kernels differ: step 1 ran forward/BiasAdd as BiasAdd, forward/MatMul as " in \
        result.stdout, result.stdout
    result = multistep("verify", "tests/test_verify.py:good_build", "--steps", "2", "--runs", "1",
                       "--explain")
    assert "kernels: same kernels in every inner step as in a single step" in result.stdout


@pytest.mark.parametrize("target,message", [
    ("missing.py:build", "no such file: missing.py"),
    ("examples/verify_my_model.py:nope", "has no function 'nope'"),
    # (a file without ":FN" is a training script now: multistep verify SCRIPT.py)
    ("examples/verify_my_model.py:", "expected FILE.py:FN"),
])
def test_verify_bad_target(target, message):
    result = multistep("verify", target)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize("option,message", [
    (["--atol", "-1"], "argument --atol: expected a number >= 0, got '-1'"),
    (["--atol", "nan"], "argument --atol: expected a number >= 0, got 'nan'"),
    (["--steps", "0"], "argument --steps: expected an integer > 0, got '0'"),
    (["--runs", "-2"], "argument --runs: expected an integer > 0, got '-2'"),
])
def test_verify_bad_option_is_a_usage_error(option, message):
    # Not "could not run FILE:FN" (the model is fine): argparse's usage error, exit 2.
    result = multistep("verify", "examples/verify_my_model.py:build", *option)
    assert result.returncode == 2
    assert "usage: multistep verify" in result.stderr and message in result.stderr, result.stderr
    assert "could not run" not in result.stderr


def test_console_script_is_installed():
    # The README installs the package; its console script must be on PATH next to python.
    script = shutil.which("multistep", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    assert script, "the `multistep` console script is not installed: pip install -e '.[test]'"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "blobs" in result.stdout and "verify" in result.stdout


@pytest.mark.parametrize("args", [["--help"], ["blobs", "--help"], ["bench", "--help"], ["verify", "--help"]])
def test_help_does_not_import_tensorflow(args):
    # --help must answer at once: TensorFlow takes seconds to import and prints start-up lines.
    code = ("import sys\nfrom multistep.tools import cli\ntry:\n    cli.main(sys.argv[1:])\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert 'tensorflow' not in sys.modules, 'help imported tensorflow'\n")
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: multistep" in result.stdout and result.stderr == ""


@pytest.mark.parametrize("argv, steps, script_args", [
    # multistep's options before the script, everything after it the script's
    (["run", "--steps", "4", "S", "3", "--steps", "9"], 4, ["3", "--steps", "9"]),
    (["verify", "--steps", "4", "S", "--", "ok"], 4, ["ok"]),
    # bench in run's order (on the previous main: "expected an integer > 0, got 'S'")
    (["bench", "--steps", "7", "S", "a"], 7, ["a"]),
    # one default N for the three (on the previous main: required, 3 and 10)
    (["run", "S"], 10, []), (["verify", "S"], 10, []), (["bench", "S"], 10, []),
    # FILE.py:FN takes no arguments: its options may follow it, as before
    (["verify", "tests/test_verify.py:good_build", "--steps", "2"], 2, None),
])
def test_run_verify_and_bench_read_one_command_line(argv, steps, script_args):
    from multistep.tools import cli

    script = os.path.join(ROOT, "tests", "scripts", "train_loop.py")
    argv = [script if a == "S" else os.path.join(ROOT, a) if a.startswith("tests/") else a
            for a in argv]
    parser = cli._parser()
    parsed, got = cli._split_script(parser, argv)
    args = parser.parse_args(parsed)
    cli._script_defaults(parser, args)
    assert (args.steps, got) == (steps, script_args)


def test_a_normal_run_keeps_tensorflow_start_up_lines_off_the_terminal(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run([sys.executable, "-m", "multistep", "graph", "--steps", "2", "--logdir",
                             str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "step_2" in result.stdout
    assert result.stderr == ""  # no absl "I0000 ...", cpu_feature_guard or cuInit lines
    shown = subprocess.run([sys.executable, "-m", "multistep", "graph", "--steps", "2", "--logdir",
                            str(tmp_path)], cwd=ROOT, env=dict(env, TF_CPP_MIN_LOG_LEVEL="0"),
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and "I0000" in shown.stderr  # the user's own level is obeyed


def test_verify_exits_2_when_the_build_fn_raises(tmp_path):
    model = tmp_path / "broken.py"
    model.write_text("def build(steps):\n    raise RuntimeError('no model here')\n")
    result = multistep("verify", f"{model}:build")
    assert result.returncode == 2, result.stderr
    assert "could not run" in result.stderr and "RuntimeError: no model here" in result.stderr


def test_blobs_in_loop_mode_verifies_bitwise(tmp_path):
    result = multistep("blobs", "--mode", "while_loop", "--steps", "50", "--runs", "2",
                       "--logdir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "mode=while_loop" in result.stdout and "max |Δ| = 0 (bitwise equal)" in result.stdout


def test_blobs_steps_auto_picks_n_and_still_verifies(tmp_path):
    result = multistep("blobs", "--steps", "auto", "--max-steps", "16", "--runs", "2",
                       "--logdir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    chosen = int(re.search(r"AutoStepsHook .* N = (\d+)", result.stdout).group(1))
    assert 1 <= chosen <= 16  # never past --max-steps
    assert f"2 runs of {chosen} steps" in result.stdout and "max |Δ| = 0 (bitwise equal)" in result.stdout


def test_blobs_on_two_replicas(tmp_path):
    """MirroredStrategy over two logical CPUs (configured by the command before its first
    session): the side-by-side table and the verification hold."""
    result = multistep("blobs", "--replicas", "2", "--steps", "3", "--runs", "2", "--optimizer", "adam",
                       "--lr", "0.1", "--logdir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "MirroredStrategy over 2 logical CPUs" in out
    rows = re.findall(r"^\s+(\d+)\s+(?:►\s+(\d+))?\s+(\d\.\d{8})\s+(\d\.\d{8})\s+(\S+)$", out, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r[2] == r[3] for r in rows)
    # The replicas' halves summed: ln 2 at ones. Rounding: the log (2u), each replica's
    # 25-term sum (24u) and its division by 50 (u), the all-reduce's one addition (u): 28u
    # relative, inside the one-device test's bound above (52u, plus the printed 5e-9).
    assert float(rows[0][2]) == pytest.approx(0.69314718, rel=0, abs=5e-9 + 52 * 2.0 ** -24 * 0.6931472)
    assert "max |Δ| = 0 (bitwise equal)" in out and ": OK" in out


def test_blobs_on_two_replicas_in_loop_mode_and_steps_auto_refused():
    """The replicas' steps, all-reduce included, as one loop body: verified bitwise. (It was
    refused: the all-reduce's merge_call could not run in a loop body.)"""
    result = multistep("blobs", "--replicas", "2", "--mode", "while_loop", "--steps", "3",
                       "--runs", "2", "--optimizer", "adam", "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    assert "max |Δ| = 0 (bitwise equal)" in result.stdout and ": OK" in result.stdout
    result = multistep("blobs", "--replicas", "2", "--steps", "auto")
    assert result.returncode == 2 and "--replicas needs a number of --steps" in result.stderr


def test_version_and_conflicting_options_answer_before_tensorflow_loads():
    import multistep

    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "from multistep.tools import cli\nsys.exit(cli.main(sys.argv[1:]))")

    def answer(*args):
        return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    version = answer("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"multistep {multistep.__version__}"
    conflict = answer("blobs", "--steps", "auto", "--mode", "unrolled")
    assert conflict.returncode == 2 and "cannot run with --mode unrolled" in conflict.stderr
    outside = answer("bench", "--cpu", "4096")
    assert outside.returncode == 2 and "is not a core this process may use" in outside.stderr
    # Issue 50: each bad invocation is answered before TensorFlow is imported (here its
    # import fails): a missing file, a bad FILE:FN, a bad number.
    for args, said in [
            (("verify", "nosuch.py:build"), "no such file: nosuch.py"),
            (("bench", "nosuch.py:build"), "no such file: nosuch.py"),
            (("verify", "examples/verify_my_model.py:"), "expected FILE.py:FN or SCRIPT.py"),
            (("verify", "examples/verify_my_model.py:no-such"), "expected FILE.py:FN"),
            (("run", "--steps", "4", "nosuch.py"), "no such file: nosuch.py"),
            (("verify", "examples/verify_my_model.py:build", "--steps", "0"),
             "expected an integer > 0, got '0'"),
            (("blobs", "--lr", "x"), "invalid float value: 'x'"),
            (("bench", "--repeats", "-1"), "expected an integer > 0, got '-1'")]:
        bad = answer(*args)
        assert bad.returncode == 2 and said in bad.stderr, (args, bad.stderr[-2000:])
        assert "Traceback" not in bad.stderr, (args, bad.stderr[-2000:])


def test_blobs_prints_its_speed_against_single_steps(tmp_path):
    """Issue 50: beside the equality table, a step of the fused run against N single
    steps (sess.run with a feed dict, make_callable), measured in the process. The line
    is there and its figures positive; their values are the benchmarks' business."""
    result = multistep("blobs", "--steps", "2", "--runs", "2", "--mode", "while_loop",
                       "--logdir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    line = re.search(r"^speed, µs a step \(median of (\d+) paired rounds, this process\): the "
                     r"2-step run ([\d.]+); 2 single steps by sess.run with a feed dict ([\d.]+) "
                     r"\(([\d.]+)x slower\), by make_callable ([\d.]+) \(([\d.]+)x\)$",
                     result.stdout, re.MULTILINE)
    assert line, result.stdout
    assert all(float(figure) > 0 for figure in line.groups())
    assert "made of: the per-call cost fusing removes" in result.stdout


COMPILED_BUILD = '''
import numpy as np, tensorflow as tf, multistep as ms
V1 = tf.compat.v1

def build(steps):
    x = V1.placeholder(tf.float32, [4, 2], name="x")
    w = V1.get_variable("w", initializer=np.ones([2, 1], np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
    train = V1.train.GradientDescentOptimizer(0.1).minimize(loss)
    program = ms.compile({"loss": loss, "train": train}, steps)
    data = np.random.RandomState(0).randn(64, 4, 2).astype(np.float32)
    return program, lambda run: {x: data[np.arange(run * steps, (run + 1) * steps) % 64]}
'''


def test_bench_times_the_users_own_step(tmp_path):
    """Issue 50: multistep bench FILE.py:FN times the build_fn's single steps against
    each mode the step allows (an ms.compile program: as built), a progress line a
    round also when piped, the table and the verdict. Figures positive; their values
    are the benchmarks' business."""
    result = multistep("bench", "examples/verify_my_model.py:build", "--steps", "2",
                       "--repeats", "2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^round 2/2: µs a step: single steps [\d.]+, unrolled", out, re.MULTILINE)
    rows = dict(re.findall(r"^(single steps|unrolled|while_loop|while_loop\+xla) +[\d.]+ +([\d.]+)x$",
                           out, re.MULTILINE))
    assert sorted(rows) == ["single steps", "unrolled", "while_loop", "while_loop+xla"], out
    assert float(rows["single steps"]) == 1.0 and all(float(g) > 0 for g in rows.values())
    verdict = re.search(r"^fusing this step gains ([\d.]+)x \((unrolled|while_loop); the call is "
                        r"(\d+) % of a step\); under XLA ([\d.]+)x", out, re.MULTILINE)
    assert verdict, out
    assert float(verdict.group(1)) == float(rows[verdict.group(2)])
    path = tmp_path / "compiled.py"
    path.write_text(COMPILED_BUILD)
    result = multistep("bench", f"{path}:build", "--steps", "3", "--repeats", "2")
    assert result.returncode == 0, result.stderr
    assert re.search(r"^while_loop +[\d.]+ +[\d.]+x$", result.stdout, re.MULTILINE), result.stdout
    assert "not timed: unrolled (an ms.compile program is timed as built)" in result.stdout
    assert "fusing this step gains" in result.stdout


def test_every_option_has_help_text():
    """Issue 50: each option of each subcommand says what it does in --help."""
    from multistep.tools import cli

    parser = cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"{name} {action.option_strings or action.dest}"
            for name, sub in commands.choices.items() for action in sub._actions
            if not isinstance(action, argparse._HelpAction) and not action.help]
    assert len(commands.choices) >= 5 and not bare, bare
