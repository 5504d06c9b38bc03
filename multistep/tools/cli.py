"""The ``multistep`` command line."""

import argparse
import contextlib
import functools
import importlib.util
import os
import re
import sys
import tempfile
import traceback

from multistep.choices import BENCH_METHODS, BENCH_PROBLEMS, MODES, OPTIMIZERS

__all__ = ["main"]


def main(argv=None):
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = None
    if argv[:1] and argv[0] in SCRIPT_COMMANDS:  # multistep's options, then SCRIPT.py ARGS
        argv, script_args = _split_script(parser, argv)
    args = parser.parse_args(argv)  # --help and usage errors end here, before TensorFlow loads
    if args.command == "blobs" and args.steps == "auto" and args.mode == "unrolled":
        parser.error("blobs: --steps auto tunes a loop's run length (mode while_loop); it "
                     "cannot run with --mode unrolled")
    if args.command in SCRIPT_COMMANDS:
        _script_defaults(parser, args)
    if args.command == "bench" and not (args.script and _is_script(args.script)):
        allowed = sorted(os.sched_getaffinity(0))
        if args.cpu is None:
            args.cpu = allowed[0]  # (a core taskset allowed, not core 0 whatever it allowed)
        elif args.cpu >= 0 and args.cpu not in allowed:
            parser.error(f"bench: --cpu {args.cpu} is not a core this process may use "
                         f"({', '.join(map(str, allowed))})")
    if script_args is not None:
        args.args = script_args
    if args.command is None:
        parser.print_help()
        return 2
    if args.command != "run":  # (run: the script imports TensorFlow itself, as written)
        _load_tensorflow()
    return args.func(args)


# One grammar for the commands that take a training script:
#   multistep {run,verify,bench} [OPTIONS] SCRIPT.py [ARGS...]
# multistep's options come before the script; everything after it (a leading "--"
# dropped) is the script's own. An option given twice is an error. N (--steps) is 10 for a
# script unless given. (FILE.py:FN, which takes no arguments, may have its options after
# it, as before.)
SCRIPT_COMMANDS = ("run", "verify", "bench")
FUSE = ("when_it_pays", "at_once")  # (ms.deferred's fuse)
FUSE_HELP = ("when_it_pays (default: a program's steps run as written until its build "
             "would pay back in the steps left, and again if fused steps prove no faster) "
             "or at_once (fused from the first step)")
DEFAULT_SCRIPT_STEPS = 10
BENCH_STEPS = (1, 10, 100, 1000)  # bench's N without a script


def _split_script(parser, argv):
    """(the arguments for argparse, the script's own arguments or None) of a run, verify
    or bench command line (see SCRIPT_COMMANDS); a repeated option is a usage error."""
    command, rest = argv[0], argv[1:]
    sub = parser._subparsers._group_actions[0].choices[command]  # noqa: SLF001
    options = {o: a for a in sub._actions for o in a.option_strings}  # noqa: SLF001
    seen = {}

    def scan(tokens, stop):
        """The options at the start of ``tokens`` (checked), up to the first positional
        when ``stop``: (options, the positional's index or None)."""
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token == "--" and stop:
                return tokens[:i], (i + 1 if i + 1 < len(tokens) else None)
            if not token.startswith("-") or token == "-":
                if stop:
                    return tokens[:i], i
                i += 1
                continue
            name = token.split("=", 1)[0]
            action = options.get(name)
            i += 1
            if action is None:
                continue  # (argparse names it)
            given = " ".join(tokens[i - 1:i + (0 if "=" in token or action.nargs == 0
                                                else 1)])
            if action.dest in seen and action.dest != "help":
                parser.error(f"{command}: {name} is given twice ({seen[action.dest]!r} and "
                             f"{given!r}): give each option once")
            seen[action.dest] = given
            if "=" in token or action.nargs == 0:
                continue
            if action.nargs in ("+", "*"):  # values up to the next option or the script
                while i < len(tokens) and not tokens[i].startswith("-") \
                        and not _looks_like_target(tokens[i]):
                    i += 1
            else:
                i += 1
        return tokens, None

    before, at = scan(rest, stop=True)
    if at is None:
        return argv, None
    target, after = rest[at], rest[at + 1:]
    if not _is_script(target):  # FILE.py:FN: its options may follow it
        more, _ = scan(after, stop=False)
        return [command, *before, *more, "--", target], None
    if after[:1] == ["--"]:
        after = after[1:]
    elif after and after[0].split("=", 1)[0] in options:
        print(f"multistep {command}: {after[0]} after {target} is the script's own argument "
              f"(multistep's options come before SCRIPT.py)", file=sys.stderr)
    return [command, *before, "--", target], after  # ("--": no option takes the target)


def _looks_like_target(token):
    return token.endswith(".py") or ".py:" in token


def _script_defaults(parser, args):
    """N of a script (DEFAULT_SCRIPT_STEPS unless given) and of FILE.py:FN (as before)."""
    target = getattr(args, "script", None) or getattr(args, "target", None)
    script = target is not None and _is_script(target)
    if args.command == "bench":
        if script and args.steps is not None and len(args.steps) > 1:
            parser.error(f"bench: a script is timed at one N: give --steps once with one "
                         f"value, got {' '.join(map(str, args.steps))}")
        if script:
            args.steps = args.steps[0] if args.steps else DEFAULT_SCRIPT_STEPS
        elif args.steps is None:
            args.steps = list(BENCH_STEPS) if target is None else [DEFAULT_SCRIPT_STEPS]
    elif args.steps is None:
        args.steps = DEFAULT_SCRIPT_STEPS if script else 3


# TensorFlow's start-up lines on a machine with no GPU: absl's info and warning lines
# printed before TF_CPP_MIN_LOG_LEVEL takes effect, and cuInit failing for want of a driver.
_STARTUP_NOISE = re.compile(
    r"^(?:[IW]\d{4} .*|WARNING: All log messages before absl::InitializeLog\(\).*"
    r"|To enable the following instructions:.*|E\d{4} .*failed call to cuInit.*)$")


def _load_tensorflow():
    """Imports TensorFlow, keeping its start-up lines off the terminal.

    Some of those lines are printed by absl before TensorFlow reads
    ``TF_CPP_MIN_LOG_LEVEL``, so the level alone cannot stop them: file
    descriptor 2 is sent to a file while TensorFlow loads and finds its
    devices, and every captured line that is not known start-up noise is
    passed on. A user who set ``TF_CPP_MIN_LOG_LEVEL`` sees everything.
    """
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        import tensorflow as tf
    else:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        with _stderr_to_file() as captured:
            import tensorflow as tf

            tf.config.list_physical_devices()  # cuInit happens here
        sys.stderr.writelines(line for line in captured if not _STARTUP_NOISE.match(line.rstrip("\n")))
    tf.get_logger().setLevel("ERROR")  # v1 deprecation notices are not ours to print


@contextlib.contextmanager
def _stderr_to_file():
    """Everything written to file descriptor 2 inside goes to a temporary file; the list
    yielded holds its lines afterwards. On an exception they are all passed on to
    stderr before the exception propagates."""
    sys.stderr.flush()
    saved, lines = os.dup(2), []
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 2)
        try:
            yield lines
        except BaseException:
            _restore(saved, file, lines)
            sys.stderr.writelines(lines)
            raise
        else:
            _restore(saved, file, lines)


def _restore(saved, file, lines):
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
    file.seek(0)
    lines.extend(file.read().decode(errors="replace").splitlines(keepends=True))


def _parser():
    from multistep import __version__

    parser = argparse.ArgumentParser(
        prog="multistep",
        description="N real descent steps in one sess.run, checked against N single steps.")
    parser.add_argument("--version", action="version", version=f"multistep {__version__}")
    sub = parser.add_subparsers(dest="command")

    blobs = sub.add_parser(
        "blobs", help="fit the make_blobs toy classifier with N-step runs beside 1-step runs")
    blobs.add_argument("--steps", type=_steps_or_auto, default=3,
                       help="inner steps per sess.run (default 3), or 'auto': ms.hooks.AutoStepsHook "
                            "picks N (loop mode) so that a run takes about --target-seconds")
    blobs.add_argument("--target-seconds", type=_positive_float, default=0.002,
                       help="with --steps auto: seconds per run to aim for (default 0.002)")
    blobs.add_argument("--max-steps", type=_positive, default=64,
                       help="with --steps auto: the most steps a run may make (default 64)")
    blobs.add_argument("--runs", type=_positive, default=12, help="N-step runs (default 12)")
    blobs.add_argument("--mode", choices=MODES, default="auto",
                       help="auto (default: while_loop, or unrolled where it is 1.25x "
                            "faster, measured), unrolled (N copies of the step) or while_loop "
                            "(one loop body, for large N)")
    blobs.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd",
                       metavar="NAME", help="the tf.compat.v1.train optimizer (default sgd): "
                                            + ", ".join(sorted(OPTIMIZERS)))
    blobs.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    blobs.add_argument("--seed", type=int, default=0, help="make_blobs random_state (default 0)")
    blobs.add_argument("--clip-value", type=_positive_float, metavar="C",
                       help="clip every gradient entry to [-C, C]")
    blobs.add_argument("--clip-norm", type=_positive_float, metavar="C",
                       help="clip each variable's gradient to L2 norm C")
    blobs.add_argument("--clip-global-norm", type=_positive_float, metavar="C",
                       help="clip all gradients to joint L2 norm C")
    blobs.add_argument("--noise-stddev", type=_positive_float, metavar="S",
                       help="add N(0, S^2) gradient noise, keyed on --seed and the global step")
    blobs.add_argument("--rule", choices=["compact-sgd"],
                       help="train with an update rule instead of --optimizer")
    blobs.add_argument("--modulus", type=_positive_float, metavar="B",
                       help="with --rule compact-sgd: weights live in [0, B)")
    blobs.add_argument("--replicas", type=_positive, default=1, metavar="R",
                       help="train under MirroredStrategy over R logical CPU devices, each "
                            "replica its share of the points, gradients all-reduced every step "
                            "(default 1: no strategy); needs a number of --steps")
    blobs.add_argument("--logdir", default=os.path.join("tensorboard_logs", "blobs"),
                       help="TensorBoard runs fused_N and single are (re)written here "
                            "(default tensorboard_logs/blobs)")
    blobs.add_argument("--quiet", action="store_true", help="no progress bar")
    blobs.set_defaults(func=_blobs)

    run = sub.add_parser(
        "run", help="run a training script as written, every session it makes deferred "
                    "(N steps a compiled run), and print the fusion report")
    run.add_argument("--steps", type=_positive, default=None,
                     help=f"the most steps of one compiled run (N, default "
                          f"{DEFAULT_SCRIPT_STEPS})")
    run.add_argument("--mode", choices=("while_loop", "unrolled"), default="while_loop",
                     help="while_loop (default: runs of fewer steps share one program) or "
                          "unrolled")
    run.add_argument("--xla", action="store_true", help="compile the steps with XLA")
    run.add_argument("--fuse", choices=FUSE, default="when_it_pays", help=FUSE_HELP)
    run.add_argument("--quiet", action="store_true", help="no fusion report at the end")
    run.add_argument("script", metavar="SCRIPT.py", type=_script,
                     help="the script, run as python SCRIPT.py ARGS would run it")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                     help="the script's own arguments (everything after SCRIPT.py)")
    run.set_defaults(func=_run)

    verify = sub.add_parser(
        "verify", help="check FILE.py:FN's N-step runs against single steps, or SCRIPT.py "
                       "under multistep run against the script as written "
                       "(exit 1 if they differ, 2 if they could not run)")
    verify.add_argument("target", metavar="FILE.py:FN | SCRIPT.py", type=_target,
                        help="a file and a build_fn(steps) -> (unrolled, feed_dict) in it; or "
                             "a training script")
    verify.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="a script's own arguments (everything after SCRIPT.py)")
    verify.add_argument("--steps", type=_positive, default=None,
                        help=f"inner steps of a fused run (default {DEFAULT_SCRIPT_STEPS} for "
                             f"a script, 3 for FILE.py:FN)")
    verify.add_argument("--runs", type=_positive, default=4,
                        help="with FILE.py:FN: fused runs compared (default 4)")
    verify.add_argument("--atol", type=_non_negative_float, default=0.0,
                        help="allowed max |Δ| (default 0: exact)")
    verify.add_argument("--explain", action="store_true",
                        help="also say whether every inner step executed a single step's kernels "
                             "(always said when the runs diverge or the kernels differ)")
    verify.add_argument("--xla", action="store_true",
                        help="compile every ms.unroll with XLA and compare the fused program "
                             "with the single-step XLA program (bitwise), reporting the "
                             "distance to plain single steps as information")
    verify.add_argument("--fuse", choices=FUSE, default="at_once",
                        help="with SCRIPT.py: when its steps are fused (default at_once: "
                             "verify checks the fused programs from the first step, even "
                             "where multistep run would run a short script as written)")
    verify.set_defaults(func=_verify)

    graph = sub.add_parser(
        "graph", help="write an unrolled graph for TensorBoard and summarise its ops per step")
    graph.add_argument("target", metavar="FILE.py:FN", nargs="?",
                       help="a build_fn(steps) -> (unrolled, feed_dict); default: the blobs model")
    graph.add_argument("--steps", type=_positive, default=3,
                       help="inner steps of the graph written (default 3)")
    graph.add_argument("--mode", choices=MODES, default="unrolled",
                       help="for the blobs model (a build_fn picks its own)")
    graph.add_argument("--logdir", default=os.path.join("tensorboard_logs", "graph"),
                       help="default tensorboard_logs/graph")
    graph.set_defaults(func=_graph)

    bench = sub.add_parser(
        "bench", help="per-step time of the modes against N x sess.run and other baselines; "
                      "or your own step (FILE.py:FN) against single steps; or SCRIPT.py as "
                      "written against multistep run")
    bench.add_argument("script", metavar="FILE.py:FN | SCRIPT.py", nargs="?", type=_target,
                       help="a build_fn(steps) -> (program, feed), as verify takes: its single "
                            "steps against each mode (paired rounds), N the first --steps "
                            "(default 10); or a training script as written against multistep "
                            "run (one N, default 10)")
    bench.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                       help="a script's own arguments (everything after SCRIPT.py)")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke run: blobs, N in {1, 10}, few repeats")
    bench.add_argument("--problems", nargs="+", choices=BENCH_PROBLEMS, default=list(BENCH_PROBLEMS),
                       help="the models timed (default: all)")
    bench.add_argument("--steps", nargs="+", type=_positive, default=None,
                       help="values of N (default 1 10 100 1000; for a script or FILE.py:FN, "
                            "one N, default 10)")
    bench.add_argument("--methods", nargs="+", choices=BENCH_METHODS, default=list(BENCH_METHODS),
                       metavar="METHOD",
                       help="the methods timed (default: all): " + ", ".join(BENCH_METHODS))
    bench.add_argument("--repeats", type=_positive, default=7, help="timed repeats (default 7)")
    bench.add_argument("--fuse", choices=FUSE, default="when_it_pays",
                       help="with SCRIPT.py, as multistep run takes it: " + FUSE_HELP)
    bench.add_argument("--cpu", type=int, default=None,
                       help="pin this process to this core (default: the first core this "
                            "process may use, as taskset allowed it); -1 leaves it unpinned")
    bench.add_argument("--out", default="bench_results",
                       help="directory for bench.csv, graph.csv and bench.png (default bench_results)")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.add_argument("--distributed", action="store_true",
                       help="also N x sess.run against fused runs of blobs under MirroredStrategy "
                            "(2 logical CPUs) and two local workers (127.0.0.1), N <= 100")
    bench.set_defaults(func=_bench)
    return parser


def _script(text):
    """An argparse type: an existing file (checked before TensorFlow loads)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def _is_script(target):
    """A bare SCRIPT.py (not FILE.py:FN)."""
    return ":" not in target or os.path.isfile(target)


def _target(text):
    """``FILE.py:FN`` or ``SCRIPT.py``, the file existing and FN a name."""
    path, name = (text.rpartition(":")[::2] if ":" in text and not os.path.isfile(text)
                  else (text, None))
    if not path or name is not None and not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected FILE.py:FN or SCRIPT.py, got {text!r}")
    return _script(path) and text


def _positive_number(convert, what, zero=False):
    """An argparse type: ``convert(text)``, required to be > 0 (>= 0 with ``zero``): a bad
    value is a usage error naming the option, before TensorFlow loads."""
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not (value >= 0 if zero else value > 0):
            bound = ">= 0" if zero else "> 0"
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {text!r}")
        return value
    return parse


_positive = _positive_number(int, "an integer")


def _steps_or_auto(text):
    return "auto" if text == "auto" else _positive(text)
_positive_float = _positive_number(float, "a number")
_non_negative_float = _positive_number(float, "a number", zero=True)


def _blob_transforms(args):
    import multistep as ms

    chosen = []
    if args.clip_value is not None:
        chosen.append(ms.clip_by_value(-args.clip_value, args.clip_value))
    if args.clip_norm is not None:
        chosen.append(ms.clip_by_norm(args.clip_norm))
    if args.clip_global_norm is not None:
        chosen.append(ms.clip_by_global_norm(args.clip_global_norm))
    if args.noise_stddev is not None:
        chosen.append(ms.add_noise(args.noise_stddev, seed=args.seed))
    return chosen


def _blobs(args):
    import tensorflow as tf

    import multistep as ms
    from multistep.tools import blobs
    from multistep.builder import summaries

    if (args.rule is None) != (args.modulus is None):
        print("multistep blobs: --rule compact-sgd and --modulus B go together", file=sys.stderr)
        return 2
    if args.replicas > 1 and args.steps == "auto":
        print("multistep blobs: --replicas needs a number of --steps (--steps auto tunes the "
              "run length on one device only, for now)", file=sys.stderr)
        return 2
    if args.replicas > 1:  # before TensorFlow makes its first session
        blobs.logical_cpus(args.replicas)
    transforms = _blob_transforms(args)
    if args.rule:
        optimizer = f"RuleOptimizer({ms.rules.compact_sgd(args.modulus).__name__}, lr={args.lr:g})"
    else:
        optimizer = f"{type(blobs.make_optimizer(args.optimizer, args.lr)).__name__}(lr={args.lr:g})"
    build = functools.partial(blobs.build, optimizer=args.rule or args.optimizer, lr=args.lr,
                              seed=args.seed, grad_transforms=transforms, modulus=args.modulus,
                              mode=args.mode, replicas=args.replicas)
    if args.steps == "auto":
        args.mode = "while_loop"
        build = functools.partial(build, mode="while_loop")
        n = _auto_steps(build, args.target_seconds, args.max_steps)
    else:
        n = args.steps
    mode = built = args.mode
    if mode == "auto":  # what it chooses for this model, and why
        with tf.Graph().as_default():
            chosen = build(n)[0]
        mode = f"auto: {chosen.mode}" + (f" ({chosen.why})" if chosen.why else "")
        built = chosen.mode
    print(f"make_blobs(n_samples=50, centers=2, n_features=2, random_state={args.seed}); "
          f"dense 2->2 from ones; {optimizer}; mode={mode}"
          + "".join(f"; {t.__name__}" for t in transforms))
    if args.replicas > 1:
        local = " (the transforms see each replica's own, before)" if transforms else ""
        print(f"MirroredStrategy over {args.replicas} logical CPUs: each replica takes its share of "
              f"the 50 points (loss: its cross-entropy sum / 50); every step all-reduces (sums) "
              f"the replicas' gradients{local}; losses summed over the replicas")
    print(f"{args.runs} runs of {n} steps (one sess.run each) beside "
          f"{args.runs * n} runs of 1 step; ► r marks the first step of {n}-step run r\n")
    report = ms.verify(build, steps=n, runs=args.runs,
                       progress=_progress_bar(args.runs, args.quiet))
    print(f"{'step':>6}  {'':>6}  {f'{n}-step loss':>12}  {'1-step loss':>12}  {'|Δ|':>8}")
    for i, (fused, single) in enumerate(zip(report.fused_losses, report.single_losses)):
        mark = f"► {i // n + 1:>3}" if i % n == 0 else ""
        print(f"{i + 1:>6}  {mark:>6}  {fused:>12.8f}  {single:>12.8f}  {abs(fused - single):>8.2g}")
    print()
    print(report.summary())
    x, y = blobs.data(args.seed)
    correct = int((blobs.predict(report.final_values, x) == y).sum())
    print(f"accuracy after {args.runs * n} steps: {correct / len(y):.3f} ({correct}/{len(y)})")
    _blobs_speed(args, functools.partial(build, mode=built), n, transforms)
    runs = {f"fused_{n}": (n, report.fused_losses), "single": (1, report.single_losses)}
    # A loop body is one block in TensorBoard's graph: under auto the graph written is the
    # same steps built unrolled, N readable blocks (said below).
    drawn = functools.partial(build, mode="unrolled") if args.mode == "auto" else build
    for run, (steps, losses) in runs.items():
        graph = tf.Graph()
        with graph.as_default():
            drawn(steps)
        summaries.write_run(os.path.join(args.logdir, run), graph, {"loss": losses})
    shown = ", built unrolled: N blocks to read," if args.mode == "auto" else ""
    print(f"TensorBoard runs {', '.join(runs)} (the {n}-step graph{shown} and a loss point per "
          f"step) written to {args.logdir}; view them with: tensorboard --logdir {args.logdir}")
    return 0 if report.ok else 1


def _blobs_speed(args, build, n, transforms):
    """The speed line: a step of the fused run against N single steps of the program as
    written before multistep, measured here, paired."""
    from multistep.tools import blobs

    if args.replicas > 1:
        print("speed: not timed with --replicas (the single-step program it would be timed "
              "against runs on one device)")
        return
    s = blobs.speed(build, n, seed=args.seed, optimizer=args.rule or args.optimizer,
                    lr=args.lr, grad_transforms=transforms, modulus=args.modulus)
    print(f"speed, µs a step (median of {s.rounds} paired rounds, this process): the "
          f"{n}-step run {s.fused_us:.1f}; {n} single steps by sess.run with a feed dict "
          f"{s.sess_run_us:.1f} ({s.over_sess_run:.2f}x slower), by make_callable "
          f"{s.callable_us:.1f} ({s.over_callable:.2f}x)")
    print("  made of: the per-call cost fusing removes (Python, feed and fetch conversion: one "
          "call a run, not one a step); TensorFlow's per-op cost stays in both (XLA compiles it "
          "away: ms.unroll(xla=True)); on a step of milliseconds the ratio is about 1x")


def _auto_steps(build, target_seconds, max_steps, runs=40):
    """The N that ``ms.hooks.AutoStepsHook`` settles on for this model on this machine:
    training runs (thrown away) until it has kept one length for 5 runs, at most ``runs``."""
    import tensorflow as tf

    import multistep as ms

    with tf.Graph().as_default():
        unrolled, _ = build(max_steps)
        hook = ms.hooks.AutoStepsHook(unrolled, target_seconds=target_seconds)
        chosen = []
        with tf.compat.v1.train.SingularMonitoredSession(hooks=[hook]) as session:
            while len(chosen) < runs and not (len(chosen) >= 5 and len(set(chosen[-5:])) == 1):
                chosen.append(len(session.run(unrolled.losses)))
    print(f"--steps auto: AutoStepsHook (target {target_seconds:g} s per run, at most {max_steps} "
          f"steps) chose run lengths {chosen}: N = {chosen[-1]}")
    return chosen[-1]


def _graph(args):
    import tensorflow as tf

    from multistep.tools import blobs
    from multistep.builder import summaries

    if args.target:
        build_fn = _load_target(args.target)
        if build_fn is None:
            return 2
    else:
        build_fn = functools.partial(blobs.build, mode=args.mode)
    graph = tf.Graph()
    with graph.as_default():
        unrolled, _ = build_fn(args.steps)
    steps, edges = summaries.graph_summary(graph, unrolled.name)
    print(f"{unrolled.name}: {args.steps} steps, {len(graph.get_operations())} ops in the graph")
    print(summaries.format_graph_summary(steps, edges))
    summaries.write_graph(graph, args.logdir)
    print(f"graph written to {args.logdir}; view it with: tensorboard --logdir {args.logdir}")
    return 0


def _run(args):
    from multistep.tools import script

    return script.run_script(args.script, args.args, steps=args.steps, mode=args.mode,
                             xla=args.xla, report=not args.quiet, fuse=args.fuse)


def _script_runs(args, record_dir, deferred, script=None):
    """The command that runs args.script in a subprocess, recording into record_dir."""
    command = [sys.executable, "-m", "multistep.tools.script", "--record",
               os.path.join(record_dir, "record.pkl")]
    if deferred:
        command += ["--steps", str(args.steps), "--report", "--fuse", args.fuse]
    return command + [script or args.script.partition(":")[0]] + list(getattr(args, "args", []))


def _record(args, deferred, what, stdin, work):
    """Runs the script once in a subprocess, in a working copy of its own; its record,
    or None (said why). ``work``: (the observed.Plan of the working directory, its
    snapshot)."""
    import pickle
    import subprocess

    from multistep.tools import observed

    with tempfile.TemporaryDirectory() as folder:
        cwd, script = os.path.join(folder, "work"), args.script.partition(":")[0]
        observed.working_copy(work[0], cwd)
        inside = os.path.relpath(os.path.abspath(script), work[0].folder)
        if not inside.startswith(os.pardir) and inside.split(os.sep)[0] in work[0].copied:
            script = os.path.join(cwd, inside)  # (the copy's, as the script's folder)
        proc = subprocess.run(_script_runs(args, folder, deferred, os.path.abspath(script)),
                              capture_output=True, input=stdin, cwd=cwd)
        stdout = proc.stdout.decode(errors="replace")
        stderr = proc.stderr.decode(errors="replace")
        path = os.path.join(folder, "record.pkl")
        if not os.path.exists(path):
            sys.stderr.write(stderr[-3000:])
            print(f"multistep verify: {what} did not finish (exit {proc.returncode})",
                  file=sys.stderr)
            return None
        with open(path, "rb") as f:
            record = pickle.load(f)
        record["files"] = observed.files_written(cwd, work[1])
    record["stderr"], record["stdout"] = stderr, stdout
    return record


def _working_directory(command):
    """(the observed.Plan of the working directory, its snapshot): what each run of the
    script copies (said here when part of it is linked instead)."""
    from multistep.tools import observed

    plan = observed.plan(os.getcwd())
    if plan.linked:
        print(f"multistep {command}: the working directory is over "
              f"{observed.COPY_LIMIT >> 20} MiB: each run's copy links "
              f"{', '.join(plan.linked)} instead (the runs share them, and what they write "
              f"there is not compared)")
    return plan, observed.snapshot(plan)


def _verify_script(args):
    from multistep.tools import observed, script

    print(f"multistep verify {args.script}: as written twice (deterministic?), then under "
          f"multistep run --steps {args.steps} --fuse {args.fuse}")
    # each run in a copy of the working directory of its own, fed the same standard input
    # (read once here unless it is a terminal)
    stdin = b"" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()
    work = _working_directory("verify")
    first = _record(args, False, "the script as written", stdin, work)
    second = first and _record(args, False, "the script as written (a second time)", stdin,
                               work)
    if second is None:
        return 2
    difference = script.compare(first, second)
    if difference is not None:
        print(f"the script as written is not deterministic: between two runs, {difference}. "
              f"Seed it (tf.compat.v1.set_random_seed, numpy's seeds) to verify it.")
        return 2
    fused = _record(args, True, "the script under multistep run", stdin, work)
    if fused is None:
        return 2
    difference = script.compare(first, fused)
    observed_difference, skipped = observed.differences(first, second, fused)
    difference = difference or observed_difference
    print(_fusion_report(fused["stderr"]))
    for what in skipped:
        print(f"not compared: {what}")
    if difference is not None:
        print(f"DIFFERENT: under multistep run, {difference}")
        unshared = fused.get("unshared") or {}
        if unshared and "exit codes" not in difference:
            what, why = next(iter(unshared.items()))
            more = f" (and {len(unshared) - 1} more)" if len(unshared) > 1 else ""
            print(f"likely cause: the compiled steps copied {what}{more}, which draws from a "
                  f"stream of its own kernel ({why}); every run through another copy of it "
                  f"moves a stream the others do not follow.")
        return 1
    print(f"OK: {len(first['runs'])} Session.run calls' values, {len(first['closes'])} "
          f"sessions' variables, its output and the {len(first['files'])} files it wrote "
          f"bitwise the same as the script as written")
    return 0


def _verify(args):
    import multistep as ms

    if _is_script(args.target):
        args.script = args.target
        return _verify_script(args)
    build_fn = _load_target(args.target)
    if build_fn is None:
        return 2
    try:
        report = ms.verify(build_fn, steps=args.steps, runs=args.runs, atol=args.atol,
                           explain=args.explain, xla=args.xla)
    except Exception:  # the model could not be built or run: not a divergence (exit 1)
        traceback.print_exc()
        print(f"multistep verify: could not run {args.target} (exit 2; 1 means the runs diverged)",
              file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1


def _progress_bar(total, quiet):
    """A Keras progress bar, or None when quiet or not writing to a terminal."""
    if quiet or not sys.stdout.isatty():
        return None
    import keras

    bar = keras.utils.Progbar(total)
    return lambda done, _total: bar.update(done)


def _bench_script(args):
    import statistics

    rounds = 3 if args.quick else args.repeats
    times, builds = {False: [], True: []}, []
    work = _working_directory("bench")
    for r in range(rounds):
        for deferred in ((False, True) if r % 2 == 0 else (True, False)):
            result = _record(args, deferred, "the script", None, work)
            if result is None:
                return 2
            times[deferred].append(result["from_first_run"])
            if deferred:
                record = result
                builds.append(record["build_seconds"])
        print(f"round {r + 1}/{rounds}: as written {times[False][-1]:.3f} s, under multistep "
              f"run {times[True][-1]:.3f} s", flush=True)
    ratios = [a / b for a, b in zip(times[False], times[True])]
    print(f"{args.script}: from its first Session.run to its end, as written "
          f"{statistics.median(times[False]):.3f} s, under multistep run --steps "
          f"{args.steps} {statistics.median(times[True]):.3f} s: "
          f"{statistics.median(ratios):.2f}x (median of {rounds} paired rounds)")
    print(_break_even(statistics.median(times[False]), statistics.median(times[True]),
                      statistics.median(builds), record["steps"]))
    print(_fusion_report(record["stderr"]))
    return 0


def _fusion_report(stderr):
    """The fusion report a script's run under multistep run printed last on ``stderr``."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("multistep deferred")]
    return "\n".join(lines[starts[0]:] if starts else [])


def _break_even(written, fused, build, steps):
    """The line that says from how many fused steps the programs' one-time cost is paid
    back: ``written`` and ``fused`` the script's times, ``build`` the programs' build and
    first runs (part of ``fused``), ``steps`` the steps the fused run made."""
    if not steps:
        return "break-even: no step was fused (the report below says why)"
    saved = (written - (fused - build)) / steps  # a fused step's gain, once built
    head = (f"break-even: the programs' build and first runs took {build:.3f} s, for "
            f"{steps} fused steps")
    if saved <= 0:
        return f"{head}; a fused step is no faster here, so fusing pays at no length"
    return (f"{head}; a fused step saves {saved * 1e6:.0f} µs, so fusing pays from about "
            f"{build / saved:.0f} steps")


def _bench(args):
    from multistep.tools import bench

    if args.script is not None and _is_script(args.script):  # (one N: _script_defaults)
        return _bench_script(args)
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})  # before TensorFlow sizes its thread pools
    if args.script is not None:
        return _bench_step(args)
    problems, steps, methods, repeats = args.problems, args.steps, args.methods, args.repeats
    keras_steps, graph_steps = 4000, [1, 10, 100, 1000]
    if args.quick:
        problems, steps, repeats, keras_steps, graph_steps = ["blobs"], [1, 10], 3, 40, [1, 10]
    pinned = f"pinned to core {args.cpu}" if args.cpu >= 0 else "not pinned"
    print(f"multistep bench: {', '.join(problems)}; N in {steps}; {repeats} repeats; {pinned}")
    graph_jobs = [(p, m, n) for p in problems for m in ("unrolled", "while_loop") for n in graph_steps]
    total = len(problems) * len(steps) * len(methods) + len(graph_jobs)
    progress = _progress_bar(total, args.quiet)
    if progress is None and not args.quiet:  # piped: a line as each is measured
        progress = lambda done, _total: _say(f"measured {done}/{total}")  # noqa: E731
    results = bench.run(problems, steps, methods, repeats=repeats, keras_steps=keras_steps,
                        progress=progress)
    costs = []
    for p, mode, n in graph_jobs:
        costs.append(bench.graph_costs(p, mode, n))
        if progress:
            progress(len(results) + len(costs), None)
    print()
    print(bench.table(results))
    print()
    print(bench.graph_table(costs))
    os.makedirs(args.out, exist_ok=True)
    written = [bench.write_csv(results, os.path.join(args.out, "bench.csv")),
               bench.write_csv(costs, os.path.join(args.out, "graph.csv"))]
    if args.distributed:
        from multistep.tools import bench_distributed

        rows = bench_distributed.distributed_rows(steps, repeats, args.quick)
        print()
        print(bench_distributed.table(rows))
        written.append(bench.write_csv(rows, os.path.join(args.out, "distributed.csv")))
    png = bench.plot(results, os.path.join(args.out, "bench.png"))
    written.append(png or "no plot: pip install matplotlib (the [plot] extra)")
    print("\nwritten: " + ", ".join(written))
    return 0


def _bench_step(args):
    """multistep bench FILE.py:FN: the user's step, single steps against each mode."""
    from multistep.tools import bench_step

    build_fn = _load_target(args.script)
    if build_fn is None:
        return 2
    steps = args.steps[0]
    rounds = 3 if args.quick else args.repeats
    pinned = f"pinned to core {args.cpu}" if args.cpu >= 0 else "not pinned"
    print(f"multistep bench {args.script}: N = {steps}, {rounds} paired rounds, {pinned}",
          flush=True)
    try:
        times = bench_step.time_step(build_fn, steps, rounds=rounds,
                                     progress=None if args.quiet else _say)
    except Exception:  # the model could not be built or run
        traceback.print_exc()
        print(f"multistep bench: could not time {args.script}", file=sys.stderr)
        return 2
    print()
    print(times.table())
    print(times.verdict())
    return 0


def _say(text):
    """A progress line, printed at once (also when piped)."""
    print(text, flush=True)


def _load_target(target):
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        print(f"multistep verify: expected FILE.py:FN, got {target!r}", file=sys.stderr)
        return None
    if not os.path.isfile(path):
        print(f"multistep verify: no such file: {path}", file=sys.stderr)
        return None
    spec = importlib.util.spec_from_file_location("_multistep_target", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:
        traceback.print_exc()
        print(f"multistep: could not import {path}", file=sys.stderr)
        return None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        print(f"multistep verify: {path} has no function {name!r} "
              f"(callables there: {', '.join(found) or 'none'})", file=sys.stderr)
        return None
    return fn


if __name__ == "__main__":
    sys.exit(main())
