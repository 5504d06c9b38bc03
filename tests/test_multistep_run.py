"""``multistep run``, ``verify`` and ``bench`` on training scripts run unchanged
(tests/scripts/), each in a subprocess: what the script prints, its exit code, its files
and the fusion report's run counts, against the script as written."""

import pathlib
import re
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).with_name("scripts")


def _multistep(*args, timeout=600, cwd=None):
    return subprocess.run([sys.executable, "-m", "multistep", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_multistep_run_prints_what_the_script_prints_fused():
    script = SCRIPTS / "train_loop.py"
    written = subprocess.run([sys.executable, str(script), "4"], capture_output=True,
                             text=True, timeout=600)
    fused = _multistep("run", "--steps", 4, "--fuse", "at_once", script, 4)
    assert written.returncode == 0 and fused.returncode == 0, fused.stderr[-2000:]
    assert fused.stdout == written.stdout  # the losses and accuracies, printed with repr
    # 32 steps: 8 an epoch, as 4 + 4 (each epoch's loss line reads the last 4)
    assert "32 steps in 8 compiled runs" in fused.stderr, fused.stderr[-2000:]


def test_multistep_run_fuses_a_long_loop_and_runs_a_short_one_as_written(tmp_path):
    # newcomer.py: a loop over range(steps), the loss printed every 50 steps. Short (30
    # steps), the program's build would not pay back: every step as written, and the
    # report says so (on the previous main the first step built the program: multistep
    # bench gave 0.72x at 300 steps). Long (5000), after the timed runs as written the
    # steps left repay the build (here by about 3x: 4989 steps left at 0.3 of 0.55 ms
    # saved against 0.22 s; a machine whose steps are faster and builds no faster may
    # decide a few decisions later): fused, the same lines printed.
    from multistep.loops import payback

    script = SCRIPTS / "newcomer.py"
    for steps in (30, 5000):
        written = subprocess.run([sys.executable, str(script), str(steps)],
                                 capture_output=True, text=True, timeout=600, cwd=tmp_path)
        fused = _multistep("run", "--steps", 10, script, steps, cwd=tmp_path)
        assert written.returncode == 0 and fused.returncode == 0, fused.stderr[-2000:]
        assert fused.stdout == written.stdout
        report = fused.stderr[fused.stderr.index("multistep deferred"):]
        line = "run as written while its program's build would not pay back yet"
        if steps == 30:
            assert "0 steps in 0 compiled runs" in report and f"30  {line}" in report, report
        else:
            timed = payback.UNTIMED_RUNS + payback.TIMED_RUNS
            waited = int(re.search(rf"(\d+)  {line}", report).group(1))
            assert waited < 1000 and (waited - timed) % payback.DECIDE_EVERY == 0, report
            assert f"{steps - waited} steps in" in report, report


def test_multistep_verify_passes_on_the_script_and_names_a_planted_difference():
    ok = _multistep("verify", "--steps", 4, SCRIPTS / "train_loop.py", 3)
    assert ok.returncode == 0 and "OK:" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    # dropout_eval.py evaluates through the step's own dropout: its draws interleave with
    # the steps' as written, and deferred too (one shared stream). (On the main before the
    # shared streams: DIFFERENT.)
    dropout = _multistep("verify", "--steps", 4, SCRIPTS / "dropout_eval.py")
    assert dropout.returncode == 0 and "OK:" in dropout.stdout, dropout.stdout
    # sample_eval.py's sampler (Multinomial) keeps its kernel's stream: found, its cause named
    planted = _multistep("verify", "--steps", 4, SCRIPTS / "sample_eval.py")
    assert planted.returncode == 1, planted.stdout + planted.stderr[-2000:]
    assert "DIFFERENT" in planted.stdout and "sample_eval.py:" in planted.stdout
    assert "likely cause: the compiled steps copied 'categorical/Multinomial' (Multinomial)" \
        in planted.stdout, planted.stdout


def test_a_script_that_raises_keeps_its_error_and_exit_code_after_its_steps_ran():
    # as written, the 3 steps before the raise are applied; verify compares the variables
    # as the script ends, and the exit codes (1 both)
    result = _multistep("verify", "--steps", 4, SCRIPTS / "train_loop.py", 1, "raise")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    raised = _multistep("run", "--steps", 4, SCRIPTS / "train_loop.py", 1, "raise")
    assert raised.returncode == 1 and "RuntimeError: the script's own error" in raised.stderr
    assert 'File "' + str(SCRIPTS / "train_loop.py") in raised.stderr


def test_multistep_bench_times_the_script_against_multistep_run():
    result = _multistep("bench", "--steps", 4, "--repeats", 1, SCRIPTS / "train_loop.py", 2)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "round 1/1: as written" in result.stdout
    assert "x (median of 1 paired rounds)" in result.stdout
    # 16 steps: too few to repay a build, so none is fused, and the lines that say why
    # (on the previous main the build was paid at the first step: 0.47x on this script
    # at 40 epochs)
    assert "break-even: no step was fused (the report below says why)" in result.stdout
    assert "multistep deferred (steps=4): 0 steps in 0 compiled runs" in result.stdout
    assert ("16  run as written while its program's build would not pay back yet "
            "(fuse='when_it_pays': multistep.loops.payback) (the run at train_loop.py:26)"
            ) in result.stdout, result.stdout


def test_the_break_even_line_says_the_build_and_from_how_many_steps_it_pays():
    # (a fused run's line; a bench run fusing from the first step gave it too, for 40 s)
    from multistep.tools import cli

    # as written 1.0 s; fused 0.7 s of which 0.2 s the build: 1000 steps saved 0.5 s
    assert cli._break_even(1.0, 0.7, 0.2, 1000) == (
        "break-even: the programs' build and first runs took 0.200 s, for 1000 fused "
        "steps; a fused step saves 500 µs, so fusing pays from about 400 steps")
    assert cli._break_even(1.0, 1.3, 0.2, 1000).endswith(
        "a fused step is no faster here, so fusing pays at no length")
    assert cli._break_even(1.0, 1.0, 0.0, 0) == (
        "break-even: no step was fused (the report below says why)")


@pytest.mark.parametrize("args, message", [
    (["run", "--steps", "4", "nosuch.py"], "no such file"),
    (["run", "--steps", "0", "x.py"], "expected an integer > 0"),
    (["verify", "nosuch.py"], "no such file"),
    # one grammar (on the previous main: the last --steps silently won; bench took the
    # script for a value of --steps)
    (["verify", "--steps", "4", "--steps=5", str(SCRIPTS / "train_loop.py")],
     "verify: --steps is given twice ('--steps 4' and '--steps=5')"),
    (["run", "--xla", "--mode", "unrolled", "--xla", str(SCRIPTS / "train_loop.py")],
     "run: --xla is given twice"),
    (["bench", "--steps", "10", "20", str(SCRIPTS / "train_loop.py")],
     "bench: a script is timed at one N"),
])
def test_bad_invocations_answer_before_tensorflow_loads(args, message):
    # TensorFlow made unimportable: an answer shows it was never imported
    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "from multistep.tools import cli\nsys.exit(cli.main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_multistep_verify_passes_on_the_loop_shapes_as_one_script():
    """Every loop shape of deferred_cases.py, unchanged, under
    `multistep run`: each Session.run call's values and each session's variables at its
    close bitwise those of the script as written."""
    result = _multistep("verify", "--steps", 4, SCRIPTS / "loop_shapes.py", timeout=900)
    assert result.returncode == 0 and "OK:" in result.stdout, (result.stdout
                                                               + result.stderr[-3000:])


def test_multistep_run_imports_nothing_before_the_script_and_its_own_deferral_wins():
    # own_deferral.py prints whether TensorFlow or numpy was loaded before its first line,
    # logs a line through TensorFlow's logger, and defers its own session (steps=3). On
    # the previous main, multistep run loaded TensorFlow first ("True True"), set its
    # logger to ERROR (the line gone), and the script failed: "deferred already".
    script = SCRIPTS / "own_deferral.py"
    written = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=600)
    fused = _multistep("run", "--steps", 4, script)
    assert written.returncode == 0 and fused.returncode == 0, fused.stderr[-2000:]
    assert fused.stdout == written.stdout  # the losses bitwise (repr), the report's runs
    assert "loaded before the script: False False" in fused.stdout
    assert "WARNING:tensorflow:the script's own warning" in fused.stderr
    assert fused.stderr.count("the script defers this session itself (ms.deferred at "
                              "own_deferral.py:24): its own steps=3 are used.") == 1
    assert "6 steps in 2 compiled runs" in fused.stderr  # the script's own deferral's


def _verify_in(folder, *args, stdin=""):
    return subprocess.run([sys.executable, "-m", "multistep", "verify", *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=folder, input=stdin)


def test_multistep_verify_compares_output_and_files_in_a_working_copy_of_its_own(tmp_path):
    # observed.py ok reads its step count from standard input, resumes from ./ckpt when
    # it is there, saves there and under mkdtemp(), writes ./losses.json. On the previous
    # main, verify called it "not deterministic" (the second run resumed from the first's
    # checkpoint; the mkdtemp path a save returns differed) and compared no file.
    # A sparse file over the copy limit beside it (a data set): linked into each copy, not
    # copied (on the previous main the whole folder was then shared: each run found the
    # checkpoints of the ones before it).
    script = SCRIPTS / "observed.py"
    with open(tmp_path / "data.bin", "wb") as f:
        f.truncate(257 << 20)
    ok = _verify_in(tmp_path, "--steps", 4, script, "ok", stdin="5\n")
    assert ok.returncode == 0, ok.stdout + ok.stderr[-2000:]
    assert "each run's copy links data.bin instead" in ok.stdout, ok.stdout
    assert "OK: 8 Session.run calls' values, 1 sessions' variables, its output and the 4 " \
           "files it wrote" in ok.stdout, ok.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["data.bin"]  # (each run had a copy)
    (tmp_path / "data.bin").unlink()
    # planted: a printed line, and a file, that hold type(loss).__name__ (Lazy deferred:
    # type() is the one question a lazy value cannot answer as its value): on the
    # previous main both were called OK
    line = _verify_in(tmp_path, "--steps", 4, script, "line")
    assert line.returncode == 1 and ("DIFFERENT: under multistep run, line 1 of its "
                                     "standard output differs: 'the last loss is float32' "
                                     "as written, 'the last loss is Lazy'") in line.stdout
    file = _verify_in(tmp_path, "--steps", 4, script, "file")
    assert file.returncode == 1 and "the file kind.json it wrote differs" in file.stdout
    # the same line on standard error, among TensorFlow's log lines and multistep's own
    # report and warnings (left out by the rule): on the previous main, OK
    error = _verify_in(tmp_path, "--steps", 4, script, "error")
    assert error.returncode == 1 and ("of its standard error differs: 'the last loss is "
                                      "float32' as written, 'the last loss is Lazy' under "
                                      "multistep run") in error.stdout, error.stdout


def test_the_pending_steps_run_before_os_exit(tmp_path):
    # exit_early.py's step writes the global step to a file; it makes 3 steps and calls
    # os._exit (atexit does not run). On the previous main the 3 steps were still pending
    # and never ran: no file.
    written = subprocess.run([sys.executable, str(SCRIPTS / "exit_early.py"),
                              str(tmp_path / "written")], capture_output=True, timeout=600)
    fused = _multistep("run", "--steps", 4, "--fuse", "at_once", SCRIPTS / "exit_early.py",
                       tmp_path / "fused")
    assert written.returncode == 0 and fused.returncode == 0, fused.stderr[-2000:]
    assert (tmp_path / "written").read_text() == (tmp_path / "fused").read_text() == "3"


def test_the_rule_leaves_out_tensorflows_log_lines_and_multisteps_own_from_stderr():
    from multistep.tools import observed

    stderr = "\n".join([
        "I0000 00:00:1796694045.018322   25933 cudart_stub.cc:31] Could not find cuda drivers",
        "WARNING:tensorflow:the script's own warning",
        "/w/train.py:26: RuntimeWarning: deferred_1: 'global_step' is fetched beside the "
        "step's write of it",
        "  _, step = sess.run([train, global_step])",
        "/w/train.py:40: UserWarning: the script's own",
        "  warnings.warn(\"the script's own\")",
        "multistep run: the script defers this session itself (ms.deferred at train.py:9)",
        "Traceback (most recent call last):",
        "multistep deferred (steps=10): 30 steps in 3 compiled runs (10.0 steps a run)",
        "  runs short of N steps, by cause:",
        "         1  a read of a value at train.py:34",
    ])
    assert observed.script_errors(stderr) == [
        "WARNING:tensorflow:the script's own warning",
        "/w/train.py:40: UserWarning: the script's own",
        "  warnings.warn(\"the script's own\")",
        "Traceback (most recent call last):"]
