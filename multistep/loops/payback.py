"""When fusing a step pays: a deferred session's rule for building a program.

A fused program costs a one-time build (the copy of the step into a loop, the session's
graph extension, Grappler and the kernels of its first run: 0.1 to 0.5 s for a small
model) and saves a part of each step's cost after it. A loop that ends before the savings
repay the build is slower fused than as written. So under ``fuse="when_it_pays"`` (the
default) a step run of a new program runs as written, timed, until one of these says the
build pays back:

- **the steps left are known**: the run call sits inside ``for ... in range(...)`` loops
  only (in the loop's frames, read from the source: ``steps_left``); the program is built
  once the steps left would save more than its build, at the gain a fused step is
  expected to make (``GAIN`` of an as-written step);
- **they are not** (a ``while`` loop, a dataset's iterator, a generator): the program is
  built once the loop has spent as long on the step as written as its build is expected
  to take (the rent-or-buy rule: never more than twice the better choice's cost).

The build is expected to cost ``BUILD_SECONDS_PER_OP`` a step op (measured here), or, once
one program was built in this process, what builds have cost so far a step op.

After the build, the fused steps are timed too (the compiled runs and the deferral of
each step); where a fused step proves no faster than a step as written, the program's
steps run as written from then on. Every step run as written says so in the report.
"""

import ast
import collections
import dataclasses
import dis
import statistics

from multistep.loops import frames

__all__ = ["BUILD_SECONDS_PER_OP", "GAIN", "Timing", "build_estimate", "built", "steps_left",
           "worth_building"]

# A program's build and first run, a step op: 219 ms for the 149 ops of a two-layer
# MLP with Adam (tests/scripts/newcomer.py, this machine); a guess before any build.
BUILD_SECONDS_PER_OP = 1.5e-3
# The part of an as-written step's time a fused step saves, assumed before it is
# measured: 0.40 on that MLP at N = 10; taken lower, so that a guess errs as written.
GAIN = 0.3
# As-written runs timed before a decision, and kept (the latest): a step as written
# costs their median. The first runs of a program are slower (its kernels made, caches
# cold: 2.2 ms against 0.57 ms for the third of that MLP's), so the first are not timed.
UNTIMED_RUNS = 3
TIMED_RUNS = 8
# Once the steps are timed, the decision is taken again every this many runs as written
# (it walks the loop's frames: about 9 µs).
DECIDE_EVERY = 8
# Fused steps timed before they are compared with steps as written.
COMPARED_STEPS = 30


@dataclasses.dataclass
class Timing:
    """One program's times: its steps as written and fused (seconds, counts)."""

    written_runs: int = 0  # as-written runs made (the first UNTIMED_RUNS not timed)
    written_seconds: float = 0.0  # the timed ones' time
    latest: collections.deque = dataclasses.field(  # the last TIMED_RUNS' times
        default_factory=lambda: collections.deque(maxlen=TIMED_RUNS))
    fused_steps: int = 0  # fused steps timed (not those of a program's first run)
    fused_seconds: float = 0.0  # their compiled runs' time and their deferral's
    fusing: bool = False  # its program is built (or due): its steps are deferred
    site: str = None  # where its first step run as written was made
    line: str = None  # the report's line for its steps run as written
    next_decision: int = 0  # the as-written run after which to decide again
    settled: bool = False  # fused, for good: compared and found faster

    def written(self, seconds):
        self.written_runs += 1
        if self.written_runs > UNTIMED_RUNS:
            self.written_seconds += seconds
            self.latest.append(seconds)

    @property
    def written_step(self):
        """Seconds an as-written step: the median of the latest timed (None: fewer than
        TIMED_RUNS yet)."""
        if len(self.latest) < TIMED_RUNS:
            return None
        return statistics.median(self.latest)

    def fused_is_slower(self):
        """Whether the fused steps, once enough were timed, prove no faster than a step as
        written (and so should run as written from now on); None until it is known."""
        if self.settled or self.fused_steps < COMPARED_STEPS or self.written_step is None:
            return None
        slower = self.fused_seconds / self.fused_steps >= self.written_step
        self.settled = not slower
        return slower


def worth_building(timing, build_seconds, left=None):
    """Whether a program whose steps ran as written (``timing``) should be built now,
    expected to cost ``build_seconds``; ``left()``: the step runs left (None: not
    known), asked only once the steps are timed."""
    if timing.written_runs < timing.next_decision:
        return False
    step = timing.written_step
    if step is None:
        return False
    timing.next_decision = timing.written_runs + DECIDE_EVERY
    steps = None if left is None else left()
    if steps is not None:
        return steps * GAIN * step > build_seconds
    return timing.written_seconds >= build_seconds


_BUILDS = [0.0, 0]  # the builds of this process: seconds, step ops


def built(seconds, ops):
    """A program of ``ops`` step ops was built, and made its first run, in ``seconds``."""
    _BUILDS[0] += seconds
    _BUILDS[1] += ops


def build_estimate(ops):
    """The expected build (and first run) of a program of ``ops`` step ops, seconds."""
    per_op = _BUILDS[0] / _BUILDS[1] if _BUILDS[1] else BUILD_SECONDS_PER_OP
    return per_op * ops


_LOOPS = {}  # (filename, first line of the code, line) -> the loops around it, outermost first


def steps_left():
    """The iterations left after the current one of the loops around the caller's run
    call, counted over every loop frame, where each is ``for NAME in range(...)`` with
    arguments that are names, constants or integer arithmetic of those (the loop's
    variable not rebound); None where any loop around it is another."""
    loops = []
    for frame in frames.loop_frames():
        around = _loops_around(frame)
        if around is None:
            return None
        loops[:0] = [(node, frame) for node in around]
    left = 0
    for node, frame in loops:
        position = _position(node, frame)
        if position is None:
            return None
        index, total = position
        left = left * total + (total - index - 1)
    return left


def _loops_around(frame):
    """The loops (``for``, ``while``, comprehensions) around ``frame``'s current line in
    its own code, outermost first. Where the code has no source (``exec`` of a string,
    ``python -c``): none where its bytecode has no loop around the current instruction,
    else None (not known)."""
    code = frame.f_code
    key = (code.co_filename, code.co_firstlineno, frame.f_lineno)
    if key not in _LOOPS:
        tree = frames.tree(code.co_filename)
        if tree is None:
            _LOOPS[key] = None if _in_a_loop(code, frame.f_lasti) else []
        else:
            _LOOPS[key] = _enclosing(tree, None, frame.f_lineno, code)
    return _LOOPS[key]


def _in_a_loop(code, offset):
    """Whether a backward jump of ``code`` encloses its instruction at ``offset``."""
    return any(i.opname.startswith("JUMP_BACKWARD") and i.argval <= offset < i.offset
               or i.opname == "FOR_ITER" and i.offset <= offset < i.argval
               for i in dis.get_instructions(code))


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _enclosing(node, function, line, code):
    found = []
    for child in ast.iter_child_nodes(node):
        if not hasattr(child, "lineno") or not child.lineno <= line <= child.end_lineno:
            continue
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found += _enclosing(child, child, line, code)
            continue
        if isinstance(child, (ast.For, ast.While, ast.AsyncFor)) and frames.same_scope(
                function, code) and any(s.lineno <= line <= s.end_lineno for s in child.body):
            found.append(child)
        elif isinstance(child, _COMPREHENSIONS):  # (a loop too: not counted)
            found.append(child)
        found += _enclosing(child, function, line, code)  # (a line may hold several)
    return found


def _position(node, frame):
    """(the index of the current iteration, the iterations in all) of a ``for NAME in
    range(...)`` loop in ``frame``, or None."""
    iterated = getattr(node, "iter", None)
    if not (isinstance(node, ast.For) and isinstance(node.target, ast.Name)
            and isinstance(iterated, ast.Call) and not iterated.keywords
            and isinstance(iterated.func, ast.Name) and iterated.func.id == "range"
            and frames.evaluate(iterated.func, frame) is range):
        return None
    arguments = [frames.evaluate(a, frame) for a in iterated.args]
    current = frame.f_locals.get(node.target.id, frames.UNKNOWN)
    if not all(type(a) is int for a in arguments + [current]):
        return None
    try:
        span = range(*arguments)
    except (TypeError, ValueError):
        return None
    if current not in span:
        return None
    return span.index(current), len(span)
