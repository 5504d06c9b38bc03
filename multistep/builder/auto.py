"""``mode="auto"``: the mode whose program runs fastest, by measurement.

``ms.unroll`` builds the step once (``loss_fn`` is called once) and descends its forward
pass twice: as the plain step (what ``"unrolled"`` and ``"while_loop"`` compile) and as
a step of an XLA loop (``Step.build_compiled``). ``choose`` then builds each candidate's
program in a scratch copy of the graph, runs them in scratch sessions (the user's
session and graph see none of it), warms each up (XLA compiles there), and times them
in interleaved rounds (the order rotated each round, so that a change of load on a
shared machine falls on every candidate alike), bounded in time. The fastest by the
median of its rounds is built in the user's graph; ``Unrolled.why`` gives the figures.

What is not timed, and why, is said there too: a candidate that cannot be built (an op
without an XLA kernel, ref variables, ...), unrolled mode past ``MOST_UNROLLED_STEPS``
(its build time grows with N). No trial at all, ``"unrolled"`` as before: over a
``tf.data`` iterator (a run would consume it) or in a ``tf.distribute`` replica context.
"""

import dataclasses
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



def untimed(feed, *, in_replica_context):
    """Why no candidate can be timed (``"unrolled"`` is built, as before), or None."""
    if in_replica_context:
        return ("in a tf.distribute replica context: each step's apply all-reduces through a "
                "merge_call, which cannot run inside a compiled program or a loop body")
    if feed.iterator is not None:
        return ("the inputs come from a tf.data iterator: XLA does not compile "
                "IteratorGetNext (batch N steps at once to compile), and a timed run would "
                "consume the iterator")
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
                call(*args)  # (XLA compiles here)
                once = time.perf_counter()
                call(*args)
                once = time.perf_counter() - once
            except tf.errors.OpError as error:
                refused[name] = f"its first runs failed: {error.message.splitlines()[0]}"
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
    best = min(medians, key=medians.get)
    rounds = len(next(iter(times.values())))
    figures = ", ".join(f"{name} {medians[name]:.1f}"
                        for name in sorted(medians, key=medians.get))
    return best, (f"timed in scratch sessions ({built:.1f} s to build and warm up, then "
                  f"{rounds} interleaved rounds), median µs a run of {steps} steps: "
                  f"{figures}; chose {best}{notes}")


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
                        refused[name] = f"its runs failed: {error.message.splitlines()[0]}"
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
