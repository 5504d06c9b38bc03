"""``multistep bench FILE.py:FN``: the user's own step, single steps against each mode.

``build_fn(steps) -> (program, feed)`` is the form ``ms.verify`` takes. Each program is
built in a graph and session of its own (``verify``'s ``_Program``): the single steps
(``build_fn(1)`` run N times, or, for an ``ms.compile`` program, its original fetches
run step by step as written) and the N-step program in each mode the step allows. They
are timed in interleaved rounds, the order rotated each round, each turn as many runs as
fill a block; the ratios are paired round by round (one round, one load on the core).
"""

import dataclasses
import statistics
import time

import tensorflow as tf

from multistep.verify import _Program as Program  # (one build in its own graph and session)
from multistep.builder.auto import MOST_UNROLLED_STEPS
from multistep.builder.unroll import forced_mode, forced_xla

__all__ = ["StepTimes", "paired_rounds", "time_step"]

MODES = ("unrolled", "while_loop", "while_loop+xla")
SINGLE = "single steps"


def paired_rounds(calls, rounds, block_seconds, progress=None):
    """Seconds a call of each of ``calls``, one figure a round: a warm-up call each, then
    ``rounds`` rounds, the order rotated each round, each turn as many calls as fill
    ``block_seconds`` (counted from a second warm-up call). ``progress(round, times)``
    after each round."""
    blocks = []
    for call in calls:
        call()
        began = time.perf_counter()
        call()
        blocks.append(max(1, int(block_seconds / max(time.perf_counter() - began, 1e-7))))
    times = [[] for _ in calls]
    order = list(range(len(calls)))
    for r in range(rounds):
        for i in order[r % len(order):] + order[:r % len(order)]:
            began = time.perf_counter()
            for _ in range(blocks[i]):
                calls[i]()
            times[i].append((time.perf_counter() - began) / blocks[i])
        if progress is not None:
            progress(r + 1, times)
    return times


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """``time_step``'s figures: µs a step of each program timed (``SINGLE`` first), the
    median of each one's per-round ratio to the single steps, and why a mode was not
    timed."""
    steps: int
    rounds: int
    us: dict
    gains: dict
    not_timed: dict

    def table(self):
        lines = [f"{'':<18}{'µs a step':>10}  {'single ÷ it':>11}"]
        for name, us in self.us.items():
            gain = 1.0 if name == SINGLE else self.gains[name]
            lines.append(f"{name:<18}{us:>10.1f}  {gain:>10.2f}x")
        lines += [f"not timed: {name} ({why})" for name, why in self.not_timed.items()]
        return "\n".join(lines)

    def verdict(self):
        """One line: the gain of the fastest mode without XLA, the share of a single step
        that is its call (what fusing removes), and XLA's gain where it was timed."""
        plain = {name: g for name, g in self.gains.items() if not name.endswith("+xla")}
        if not plain:
            return "no fused mode could be timed: " + "; ".join(
                f"{name}: {why}" for name, why in self.not_timed.items())
        best = max(plain, key=plain.get)
        call = max(0.0, 1 - 1 / plain[best]) * 100
        text = (f"fusing this step gains {plain[best]:.2f}x ({best}; the call is {call:.0f} % "
                f"of a step)")
        xla = {name: g for name, g in self.gains.items() if name.endswith("+xla")}
        for name, gain in xla.items():
            text += (f"; under XLA {gain:.2f}x ({name}: XLA's rounding, bitwise with the step "
                     f"compiled alone, not with plain single steps)")
        return text


def time_step(build_fn, steps, *, rounds=7, block_seconds=0.05, progress=None):
    """Times ``build_fn``'s step: ``steps`` single steps against one ``steps``-step run in
    each mode the step allows. ``progress(text)`` gets a line as each program is built
    and after each round. Returns ``StepTimes``."""
    say = progress or (lambda text: None)
    programs, not_timed = {}, {}
    try:
        for mode in MODES:
            if mode == "unrolled" and steps > MOST_UNROLLED_STEPS:
                not_timed[mode] = f"N > {MOST_UNROLLED_STEPS}: N copies to build"
                continue
            say(f"building {mode} ({steps} steps)")
            try:
                with forced_mode(mode.split("+")[0]), forced_xla(mode.endswith("+xla")):
                    program = Program(build_fn, steps)
                program.run(0)  # (the first run: XLA compiles, the kernels traced)
            except (TypeError, ValueError, tf.errors.OpError) as error:
                not_timed[mode] = _first_line(error)
                continue
            if program.compiled:  # ms.compile's program: the mode it was built in
                programs[program.mode] = program
                not_timed.update({m: "an ms.compile program is timed as built"
                                  for m in MODES if m != program.mode and m not in not_timed})
                break
            programs[mode] = program
        if not programs:
            raise ValueError(f"build_fn({steps}) could not be built in any mode: " + "; ".join(
                f"{mode}: {why}" for mode, why in not_timed.items()))
        compiled = next(iter(programs.values()))
        say("building the single steps")
        with forced_mode("unrolled"), forced_xla(False):
            single = (Program(build_fn, steps, as_written=True)
                      if compiled.compiled else Program(build_fn, 1))
        programs = {SINGLE: single, **programs}
        calls = [_runs(program, steps) for program in programs.values()]
        names = list(programs)

        def report(r, times):
            figures = ", ".join(f"{name} {t[-1] / steps * 1e6:.1f}" for name, t in zip(names, times))
            say(f"round {r}/{rounds}: µs a step: {figures}")
        times = paired_rounds(calls, rounds, block_seconds, report)
    finally:
        for program in programs.values():
            program.close()
    us = {name: statistics.median(t) / steps * 1e6 for name, t in zip(names, times)}
    gains = {name: statistics.median(a / b for a, b in zip(times[0], t))
             for name, t in zip(names[1:], times[1:])}
    return StepTimes(steps, rounds, us, gains, not_timed)


def _runs(program, steps):
    """A call that runs ``steps`` steps of ``program``, each call the next run's feed."""
    count = iter(range(10 ** 12))
    if program.steps == 1:  # single steps of a build_fn(1): run i*N .. i*N + N - 1
        def call():
            start = next(count) * steps
            for j in range(steps):
                program.run(start + j)
    elif getattr(program, "as_written", False):
        def call():
            program.run_as_written(next(count))
    else:
        def call():
            program.run(next(count))
    return call


def _first_line(error):
    text = getattr(error, "message", None) or str(error)
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
