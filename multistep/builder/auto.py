"""``mode="auto"``: the mode whose program runs fastest, by measurement, among modes
that give the same bits.

``ms.unroll`` builds the step once (``loss_fn`` is called once); its candidates are
loop mode (the default) and unrolled steps, which train to the same bits (XLA only
when the user asks for it: another rounding). ``choose`` then builds each candidate's
program in a scratch copy of the graph, runs them in scratch sessions (the user's
session and graph see none of it), warms each up, and times them
in interleaved rounds (the order rotated each round, so that a change of load on a
shared machine falls on every candidate alike), bounded in time. The default is built
in the user's graph unless another is ``MARGIN`` times faster, paired round by round,
so that noise cannot flip the choice from build to build; the same program built again
in the process (``ms.verify`` builds it twice) gets the choice made for it the first
time. ``Unrolled.why`` gives the figures.

What is not timed, and why, is said there too: a candidate that cannot be built or run,
unrolled mode past ``MOST_UNROLLED_STEPS`` (its build time grows with N) or over stateful
random ops (each copy would restart the stream: other bits). No trial at all,
``"unrolled"`` as before: over a ``tf.data`` iterator (a run would consume it) or in a
``tf.distribute`` replica context.
"""

import dataclasses
import hashlib
import io
import statistics
import sys
import time
import warnings

import numpy as np
import tensorflow as tf

from multistep import graph as graph_lib

__all__ = ["choose", "untimed"]

TRIAL_SECONDS = 2.0  # the timed rounds (after the builds and one warm-up run each)
LEAST_ROUNDS, MOST_ROUNDS = 5, 15
BLOCK_SECONDS = 0.01  # one candidate's turn in a round: as many runs as fill it
MOST_UNROLLED_STEPS = 64  # past it unrolled mode is not a candidate (N copies to build)
_CHOSEN = {}  # (the program's graph, the candidates, N, the name) -> (mode, why)
MARGIN = 1.25  # another mode than the default (the first candidate) is chosen only if
# it is this many times faster: a shared core's noise (round to round within 10 %) cannot
# flip the choice from build to build.



def untimed(feed, *, in_replica_context):
    """Why no candidate can be timed (``"unrolled"`` is built, as before), or None."""
    if in_replica_context:
        return ("in a tf.distribute replica context: each step's apply all-reduces through a "
                "merge_call, which cannot run inside a compiled program or a loop body")
    if feed.iterator is not None:
        return "the inputs come from a tf.data iterator, which a timed run would consume"
    return None


def choose(graph, candidates, build, label, steps, *, refused=None, seconds=TRIAL_SECONDS,
           out=None):
    """The fastest of ``candidates`` (mode names), and the text that says so.

    ``build(name, find)`` builds that candidate's program in the current graph (a copy of
    ``graph``; ``find`` maps a tensor or op of ``graph`` to its copy) and returns what a
    run fetches; it may raise ``TypeError`` or ``ValueError``, which takes the candidate
    out (the message says why). ``refused``: {name: why} of candidates not tried.
    Progress goes to ``out`` (stderr, where it is a terminal). Returns (name, why)."""
    if out is None:
        out = sys.stderr if sys.stderr.isatty() else io.StringIO()
    refused = dict(refused or {})
    meta = tf.compat.v1.train.export_meta_graph(graph=graph)
    key = (hashlib.sha256(meta.graph_def.SerializeToString(deterministic=True)).hexdigest(),
           tuple(candidates), tuple(sorted(refused.items())), steps, label)
    if key in _CHOSEN:  # the same program built again in this process: the same choice
        best, why = _CHOSEN[key]
        return best, f"as chosen for the same program earlier in this process ({why})"
    runs, sessions = {}, []
    started = time.perf_counter()
    try:
        for name in candidates:
            out.write(f"\r{label}: mode='auto' building {name} to time it...")
            out.flush()
            scratch = tf.Graph()
            with scratch.as_default(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the build in the user's graph warns)
                tf.compat.v1.train.import_meta_graph(meta)
                try:
                    fetch = build(name, lambda x, g=scratch: g.as_graph_element(x.name))
                except (TypeError, ValueError) as error:
                    refused[name] = str(error).split("\n")[0]
                    continue
                init = tf.group(tf.compat.v1.global_variables_initializer(),
                                tf.compat.v1.local_variables_initializer())
            feeds = _zero_feeds(fetch)
            if feeds is None:
                refused[name] = "an input placeholder has no static shape to time it with"
                continue
            session = tf.compat.v1.Session(graph=scratch)
            sessions.append(session)
            session.run(init)
            call = session.make_callable(fetch, feed_list=list(feeds))
            args = list(feeds.values())
            try:
                call(*args)
                once = time.perf_counter()
                call(*args)
                once = time.perf_counter() - once
            except tf.errors.OpError as error:
                refused[name] = f"its first runs failed: {_first_line(error)}"
                continue
            runs[name] = _Run(call, args, lambda s=session, i=init: s.run(i),
                              max(1, int(BLOCK_SECONDS / max(once, 1e-6))))
        built = time.perf_counter() - started
        times = _rounds(runs, seconds, label, out, refused)
    finally:
        for session in sessions:
            session.close()
        out.write("\n")
        out.flush()
    medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    notes = "".join(f"; not timed: {name} ({why})" for name, why in refused.items())
    if not medians:
        return "unrolled", f"no candidate could be timed{notes}"
    best, margin = _with_margin([name for name in candidates if name in times], times)
    rounds = len(next(iter(times.values())))
    figures = ", ".join(f"{name} {medians[name]:.1f}"
                        for name in sorted(medians, key=medians.get))
    _CHOSEN[key] = best, (f"timed in scratch sessions ({built:.1f} s to build and warm up, "
                          f"then {rounds} interleaved rounds), median µs a run of {steps} "
                          f"steps: {figures}; chose {best}{margin}{notes}")
    return _CHOSEN[key]


def _with_margin(names, times):
    """The first of ``names`` (the default), unless another is faster by ``MARGIN`` in
    the median of its per-round ratios to it (paired: one round, one load); and the text
    that says so. Noise within the margin cannot change the choice."""
    first = names[0]
    ratios = {name: statistics.median(a / b for a, b in zip(times[first], times[name]))
              for name in names[1:]}
    faster = [name for name in ratios if ratios[name] >= MARGIN]
    if not faster:
        return first, (f" (the default: no other mode {MARGIN:g}x faster in paired rounds)"
                       if ratios else "")
    best = max(faster, key=ratios.get)
    return best, f" ({ratios[best]:.2f}x {first} in paired rounds; the margin is {MARGIN:g}x)"


@dataclasses.dataclass
class _Run:
    call: object  # a run of the candidate's program (make_callable)
    args: list  # its feeds
    reset: object  # its variables back to their initial values
    block: int  # runs a turn


def _rounds(runs, seconds, label, out, refused):
    """Per-run times (s) of each candidate, one per round, the order rotated each round.
    Each turn starts from the initial values (untimed): the trial trains, and a run
    that diverged would time another program (a check that raises, NaN arithmetic). A
    turn that fails anyway is run again with fewer runs; a candidate that fails with
    one run a turn is taken out (``refused``)."""
    times = {name: [] for name in runs}
    order = list(runs)
    start = time.perf_counter()
    rounds = 0
    while order and (rounds < LEAST_ROUNDS or (
            rounds < MOST_ROUNDS and time.perf_counter() - start < seconds)):
        for name in order[rounds % len(order):] + order[:rounds % len(order)]:
            run = runs[name]
            while True:
                run.reset()
                try:
                    began = time.perf_counter()
                    for _ in range(run.block):
                        run.call(*run.args)
                    times[name].append((time.perf_counter() - began) / run.block)
                    break
                except tf.errors.OpError as error:
                    if run.block == 1:
                        refused[name] = f"its runs failed: {_first_line(error)}"
                        break
                    run.block = max(1, run.block // 4)
        for name in refused:
            if name in times:
                order.remove(name)
                del times[name]
        rounds += 1
        out.write(f"\r{label}: mode='auto' timing {', '.join(order)}: round {rounds}"
                  + " " * 8)
        out.flush()
    return times


def _first_line(error):
    """The first line of an OpError's message that says what failed (TensorFlow opens
    graph-mode messages with "Graph execution error:", and ends lines with the node)."""
    said = [line.strip() for line in error.message.splitlines()
            if line.strip() and line.strip() != "Graph execution error:"
            and not line.strip().startswith(("[[", "Detected at node"))]
    return said[0] if said else type(error).__name__


def _zero_feeds(fetch):
    """{placeholder a run of ``fetch`` needs: zeros of its shape}, or None if one has no
    static shape."""
    feeds = {}
    for op in graph_lib.ancestors([fetch.op]):
        if op.type == "Placeholder":
            shape = op.outputs[0].shape
            if not shape.is_fully_defined():
                return None
            feeds[op.outputs[0]] = np.zeros(shape.as_list(), op.outputs[0].dtype.as_numpy_dtype)
    return feeds
