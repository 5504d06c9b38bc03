"""The deferred session: a TF1 training loop as written, its steps run N at a time.

``sess = ms.deferred(sess, steps=N)`` is the one changed line. A *step run* (a ``run``
whose fetches reach an optimizer's update of a variable) is deferred: its feed values are
copied, and it returns the fetches' structure with a ``Lazy`` for each tensor and ``None``
for each op, as ``Session.run`` does. The pending steps run as one program that
``ms.compile`` builds from the step's own fetches (once per fetch structure and fed keys):

- when N are pending;
- when Python reads a lazy value (``float(loss)``, ``print(loss)``, ``if loss < best``);
- at a *barrier*: any other run (an evaluation, ``Saver.save``, an initializer,
  ``variable.eval()``), a step run of another program (a GAN's other train op),
  ``options``/``run_metadata``, ``make_callable``'s callables, ``close``, interpreter exit,
  ``sess.flush()``.

Barriers make it right by construction: every run the loop makes sees the state of
exactly the steps the loop made before it, as in the program as written. A value of the
previous step fed back (an RNN's final state fed to its initial state) is carried inside
the program (``ms.compile(carry=...)``) rather than forcing a run.

Every ``run`` reaches the session through one patched ``BaseSession.run``, so a run made
through the original session object (a ``Saver``, a hook, ``tensor.eval()``) is a barrier
too; sessions that are not deferred run as before. A run from another thread (an evaluation
thread, a ``Supervisor``'s summary thread, a ``threading.Timer``'s save) runs the main
loop's pending steps first, so it sees the steps the loop made before it; no lock is held
across a run that is not a compiled one.

Some steps run as written, one at a time, each a line of the report: a step that calls
Python (``py_func``, ``numpy_function``, ``py_function``), a step that prints
(``tf.print``: its lines interleave with the loop's), a step that dequeues from a
queue threads fill (``shuffle_batch``, ``batch`` with queue runners), a step
``ms.compile`` refuses (a race the program has, an op it cannot copy), and a step that
can fail (an iterator's end, a check) run inside a ``try`` of the loop's that catches its
error (``caught.catching``). Deferring any of them would change what the script as
written observes.
"""

import atexit
import collections
import copy
import dataclasses
import os
import re
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.client import session as session_lib

from multistep import graph as graph_lib
from multistep import _session_hook
from multistep.compiler import streams as streams_lib
from multistep.compiler import tripwires as tripwires_lib
from multistep.compiler.compile import compile_program
from multistep.compiler.placement import PLACEHOLDERS
from multistep.compiler.runs import InputExhaustedError, StepFailedError
from multistep.loops import caught as caught_lib
from multistep.loops import lazy as lazy_lib
from multistep.loops import payback

__all__ = ["DeferredSession", "FusionReport", "deferred"]

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TF_DIR = os.path.dirname(os.path.abspath(tf.__file__)) + os.sep
_LIBRARY_DIRS = (_TF_DIR, os.path.dirname(os.path.abspath(np.__file__)) + os.sep)
# TensorFlow's optimizer kernels: a run whose fetches reach one is a training step.
_APPLY_PREFIXES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply")

# A step read as soon as it runs this many times in a row runs as written from then on:
# deferring a value read at once only adds the deferral's cost.
READ_AT_ONCE = 8
_ENGINES = weakref.WeakKeyDictionary()  # raw tf.compat.v1.Session -> _Engine
_ALL = []  # every _Engine made, in order (small: an engine holds its session weakly)
_ORIGINAL = {}  # BaseSession method name -> TensorFlow's own
_AUTO = {}  # multistep run: every new session deferred with these options


class FusionReport:
    """What a deferred session ran: ``steps`` (deferred step runs made), ``runs`` (the
    compiled runs that made them), ``direct`` (step runs made one at a time, with the
    reason), ``causes``: each reason a compiled run was short of N, with the source
    line that caused it, most frequent first, and ``build_seconds``: the time its
    programs took to build and to make their first runs."""

    def __init__(self, steps_per_run, steps, runs, direct, causes, barriers,
                 build_seconds=0.0):
        self.steps_per_run, self.steps, self.runs = steps_per_run, steps, runs
        self.direct, self.causes, self.barriers = direct, causes, barriers
        # the one-time cost: each program's build and its first run (kernels made)
        self.build_seconds = build_seconds

    @property
    def mean_steps(self):
        """The mean steps of a compiled run."""
        return self.steps / self.runs if self.runs else 0.0

    def __str__(self):
        lines = [f"multistep deferred (steps={self.steps_per_run}): {self.steps} steps in "
                 f"{self.runs} compiled runs ({self.mean_steps:.1f} steps a run), "
                 f"{self.barriers} other runs"]
        if self.direct:
            lines.append(f"  {sum(self.direct.values())} steps run one at a time:")
            lines += [f"    {n:6d}  {why}" for why, n in self.direct.most_common()]
        if self.causes:
            lines.append("  runs short of N steps, by cause:")
            lines += [f"    {n:6d}  {cause}" for cause, n in self.causes.most_common()]
        return "\n".join(lines)


class _Record:
    """One deferred step run: its feed (the fed values, in the order of its ``_Kind``'s
    keys), where it was made (``site``, and ``call``: the number of the run call), and,
    once it ran, its values or its error."""

    __slots__ = ("engine", "feed", "site", "call", "done", "values", "error", "lazies")

    def __init__(self, engine, feed, site, call):
        self.engine, self.feed, self.site, self.call = engine, feed, site, call
        self.done, self.values, self.error = False, None, None
        self.lazies = ()  # the Lazy values the run returned, settled as soon as it ran

    def resolved(self):
        """Settles the values the run returned and lets go of what only the run needed
        (the feed's copies, the step's values): a value the loop keeps holds no more."""
        for index, lazy in self.lazies:
            lazy._settle(self, index)  # noqa: SLF001
        self.lazies = ()
        self.values = self.feed = None


@dataclasses.dataclass(eq=False)
class _Kind:
    """What ``run`` learnt of a fetch structure and fed keys, once: whether it is a step
    run, and the fetches as graph elements."""

    step: bool
    flat: list  # the fetches as graph elements, in flatten_fetches's order
    keys: tuple  # the fed keys, as graph elements (tensors)
    reached: frozenset  # what the fetches depend on
    name: tuple  # the structure, the fetches' and the fed keys' names
    computed: tuple  # the indices of fed keys the step computes (not placeholders)
    unread: frozenset  # the indices of fed keys the step does not read (dropped)
    remapped: bool = False  # a fetch is a random op's own output: flat holds its stream's
    direct: str = None  # why its steps run as written, one at a time (None: deferred)
    fails: tuple = None  # (an op that can fail, named; the errors such ops raise) or None
    types: list = None  # the type Session.run returns for each fetch (None: not known)
    tensors: list = None  # the indices of the fetches that are not ops (they have values)
    read_at_once: int = 0  # its runs in a row of one step, each ended by a read of it
    held: list = dataclasses.field(default_factory=list)
    last_feed: list = None  # the feed of the last step of this kind
    hits: tuple = None  # (programs watched, the original ops they copy that it runs)
    timing: payback.Timing = dataclasses.field(default_factory=payback.Timing)


@dataclasses.dataclass(eq=False)
class _Pending:
    session: object  # (held: a session with pending steps is not collected)
    kind: _Kind
    records: list
    links: dict  # fed key's index -> index of the fetch of the step before it fed to it
    shapes: list  # the shapes of the first step's fed values


class _Engine:
    """The deferral of one raw session."""

    def __init__(self, session, steps, mode, xla, report_on_close=False,
                 fuse="when_it_pays"):
        # The session weakly: a session the loop drops is collected (and closed) as it
        # would be as written; while steps are pending, _Pending holds it.
        self._session = weakref.ref(session)
        self.steps, self.mode, self.xla, self.fuse = steps, mode, xla, fuse
        _ALL.append(self)
        self.report_on_close = report_on_close
        self.lock = threading.RLock()
        self.owner = threading.get_ident()
        self.local = threading.local()
        self.kinds = {}  # (ids of the fetches and fed keys) -> _Kind
        self.canonical = {}  # _Kind.name -> _Kind: one per program, however it is fetched
        self.programs = {}
        self.guarded, self.warned = {}, set()  # original op -> (program, effect); warned
        self.pending = None
        self.calls = 0
        self.stats_steps = self.stats_runs = self.stats_barriers = 0
        self.direct = collections.Counter()
        self.causes = collections.Counter()
        self.closed = False
        self.failed = None  # (a step's error raised at a read, the read's site): see force
        self.auto = False  # made by multistep run (a script's own ms.deferred replaces it)
        self.build_seconds, self.unrun = 0.0, set()  # (unrun: ids of programs not run yet)
        self.run_seconds = 0.0  # in flushes (builds, compiled runs): not a deferral's own

    @property
    def session(self):
        return self._session()

    # -- entry points ------------------------------------------------------------------

    def bypassing(self):
        """Whether a run now goes straight to the session: the engine's own runs, another
        thread's, or after close."""
        return (getattr(self.local, "depth", 0) > 0 or threading.get_ident() != self.owner
                or self.closed)

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        with self.lock:
            self.calls += 1
            kind, order = self._kind(fetches, feed_dict)
            if self.failed is not None and kind.step:
                self._raise_again()
            waiting = (kind.step and kind.direct is None and self.fuse == "when_it_pays"
                       and not kind.timing.fusing and not kind.fails
                       and not _meaningful(options)
                       and not self._pays(kind))  # (the common case first: nothing else read)
            if waiting:
                self._as_written(kind)
            else:
                site = _Site()  # (formatted where it is said)
                direct = kind.direct
                if kind.step and direct is None and kind.fails:
                    where = caught_lib.catching(kind.fails[1])
                    if where is not None:  # (deferred, the loop would go past the failing step)
                        direct = (f"the step can fail ({kind.fails[0]}) and the loop catches "
                                  f"its error (the try at {where}): it must stop at the step "
                                  f"that fails, as written")
                if kind.step and direct is None and not _meaningful(options):
                    if self.fuse == "at_once" or self._pays(kind):
                        return self._timed_defer(kind, feed_dict, order, site, fetches)
                    waiting = True  # (a step that can fail, its error not caught)
                    self._as_written(kind)
                elif kind.step and direct is not None:  # a step that must run as written
                    self.flush(f"a step run as written at {site}")
                    self.direct[f"{direct} (the run at {site})"] += 1
                else:
                    what = "a run with RunOptions" if kind.step else "another run"
                    self._before_barrier(kind, f"{what} at {site}")
            if kind.remapped:
                fetches = _pack(fetches, iter(kind.flat))
        # (no lock held across it: a run another thread's run must let finish, such as a
        # dequeue from a queue that thread fills, cannot wait on this one)
        if not waiting:
            return self._raw(fetches, _forced(feed_dict), options, run_metadata)
        start = time.perf_counter()
        values = self._raw(fetches, _forced(feed_dict), None, run_metadata)
        kind.timing.written(time.perf_counter() - start)
        return values

    def _as_written(self, kind):
        """Before a step run as written, timed, while its program would not pay back. Its
        report line names the first run call of its program made so (one site a
        program: a frame walk saved a step)."""
        timing = kind.timing
        if timing.site is None:
            timing.site = _site()
            timing.line = f"{_NOT_PAID_YET} (the run at {timing.site})"
        if self.pending is not None:
            self.flush(f"a step run as written at {timing.site}")
        self.direct[timing.line] += 1

    def _raise_again(self):
        (error, read), self.failed = self.failed, None  # (once: it stops the loop there)
        raise type(error)(
            error.node_def, error.op,
            f"{error.message}\nmultistep.deferred: raised again at this run call: the "
            f"loop went on after this error was raised at a read of a value at {read}, "
            f"which did not stop it (caught or swallowed there: logging's formatting "
            f"swallows errors); as written the loop stops at the failing step's run "
            f"call.") from error

    def flush(self, cause=None):
        """Runs the pending steps (one compiled run); ``cause`` says why it is short."""
        with self.lock:
            pending, self.pending = self.pending, None
            if pending is None:
                return
            if cause is not None and len(pending.records) < self.steps:
                self.causes[cause] += 1
            kind = pending.kind
            if len(pending.records) == 1 and (cause or "").startswith("a read of a value"):
                kind.read_at_once += 1  # (a site that reads each step as soon as it runs:
                if kind.read_at_once == READ_AT_ONCE and kind.direct is None:  # as written)
                    kind.direct = (f"its values are read as soon as it runs, step after step "
                                   f"(at {cause.rpartition(' at ')[2]}): it runs as written")
            else:
                kind.read_at_once = 0
            start = time.perf_counter()
            try:
                self._run_pending(pending)
            finally:
                self.run_seconds += time.perf_counter() - start
                for record in pending.records:
                    if record.done:
                        record.resolved()

    def force(self, record):
        """A read of a pending value: runs the steps pending up to it. Where a step fails
        (a check), its error is raised here, at the read, and again at the next step run
        call: a read can be where the loop's code swallows errors (``logging``'s
        formatting, an ``except`` around a ``print``), but as written the error was raised
        at the failing step's run call, which no ``try`` of the loop's catches
        (``caught``: else it runs as written), so the loop as written stops there. (The
        input's end is left to what takes it as written: a ``MonitoredSession`` ends
        training on it and runs its hooks' ``end``.)"""
        site = _site()
        try:
            self.flush(f"a read of a value at {site}")
        except tf.errors.OutOfRangeError:
            raise
        except tf.errors.OpError as error:
            self.failed = (error, site)
            raise
        if not record.done:  # (flushed by an earlier error: resolved as failed)
            raise RuntimeError("multistep.deferred: a value of a step that never ran.")

    def close(self):
        try:
            self.flush(f"close at {_site()}")
        finally:
            self.closed = True
            if self.report_on_close:
                print(str(self.report()).splitlines()[0], file=sys.stderr)

    def report(self):
        return FusionReport(self.steps, self.stats_steps, self.stats_runs, self.direct,
                            self.causes, self.stats_barriers, self.build_seconds)

    # -- one call ----------------------------------------------------------------------

    def _pays(self, kind):
        """Whether ``kind``'s steps are fused (``fuse="when_it_pays"``): once its
        program's build pays back (``payback``), for good."""
        timing = kind.timing
        if not timing.fusing and timing.written_runs >= timing.next_decision:
            timing.fusing = payback.worth_building(
                timing, payback.build_estimate(len(kind.reached)), payback.steps_left)
        return timing.fusing

    def _timed_defer(self, kind, feed_dict, order, site, fetches):
        """``_defer``, its own time (not the compiled runs' it makes) kept in the
        kind's timing."""
        ran, start = self.run_seconds, time.perf_counter()
        try:
            return self._defer(kind, self._copied_feed(kind, feed_dict, order), site,
                               fetches)
        finally:
            kind.timing.fused_seconds += (time.perf_counter() - start
                                          - (self.run_seconds - ran))

    def _before_barrier(self, kind, cause):
        """A run that is not deferred: the pending steps first, and the warning where it
        runs an original op the compiled programs copy."""
        self.flush(cause)
        if kind.hits is None or kind.hits[0] != len(self.guarded):  # (once a program)
            kind.hits = (len(self.guarded), [op for op in kind.reached if op in self.guarded])
        for op in kind.hits[1]:
            if op not in self.warned:
                self.warned.add(op)
                label, effect = self.guarded[op]
                what = [f"'{op.name}' ({op.type})"]
                warnings.warn(tripwires_lib.ran_message(label, what, effect)
                              + f" (the run at {cause.rpartition(' at ')[2]})",
                              tripwires_lib.OriginalOpRanWarning,
                              stacklevel=graph_lib.user_stacklevel())
        self.stats_barriers += 1

    def _raw(self, *args):
        self.local.depth = getattr(self.local, "depth", 0) + 1
        try:
            return _ORIGINAL["run"](self.session, *args)
        finally:
            self.local.depth -= 1

    def _kind(self, fetches, feed_dict):
        """(the ``_Kind`` of a run, the order of its feed dict's values in the kind's keys:
        None where it is theirs). Feed dicts that differ only in their keys' order are one
        kind, one program."""
        fast = (_structure_key(fetches), tuple(map(id, feed_dict or ())))
        known = self.kinds.get(fast)
        if known is None:
            kind = _classify(self.session.graph, fetches, feed_dict)
            kind = self.canonical.setdefault(kind.name, kind)
            names = [_key_name(k) for k in _graph_keys(self.session.graph, feed_dict)]
            order = tuple(names.index(_key_name(k)) for k in kind.keys)
            if len(self.kinds) > 4096:  # fetch lists of fresh strings: keep the cache small
                self.kinds.clear()
                for canonical in self.canonical.values():
                    canonical.held.clear()
            known = self.kinds[fast] = (kind, None if order == tuple(range(len(order)))
                                        else order)
            kind.held.append((fetches, list(feed_dict or ())))  # keeps the key's ids alive
        return known

    def _copied_feed(self, kind, feed_dict, order=None):
        """The feed of one step run, as a list in the order of ``kind.keys`` (``order``:
        where each is among the feed dict's values, None: in order), each value copied
        (the loop may reuse its buffers); a lazy value of the last pending step of this
        program kept as it is (carried), any other lazy value forced."""
        feed = []
        values = (feed_dict or {}).values()
        if order is not None:
            values = list(values)
            values = [values[i] for i in order]
        for key, value in zip(kind.keys, values):
            if type(value) is lazy_lib.Lazy:  # (first: it answers isinstance as its value)
                if value._owner is not self:  # noqa: SLF001
                    raise ValueError(
                        f"multistep.deferred: the value fed to {_key_name(key)!r} is a lazy "
                        f"value of another session's deferred steps; feed it as a value "
                        f"of its own: ms.value(x) runs that session's pending steps and "
                        f"returns it.")
                if self._carried_from(kind, value) is None:
                    value = value._force()  # noqa: SLF001 (runs the steps it needs)
            elif isinstance(value, np.ndarray):
                value = value.copy()
            elif not isinstance(value, (int, float, bool, str, bytes, np.generic)):
                value = copy.deepcopy(value)
            feed.append(value)
        return feed

    def _carried_from(self, kind, value):
        """The index of the fetch of the last pending step of ``kind`` that ``value`` is,
        or None."""
        pending, fetch = self.pending, value._fetch  # noqa: SLF001
        if pending is None or pending.kind is not kind or fetch is None:
            return None
        record, index = fetch
        return index if record is pending.records[-1] else None

    def _defer(self, kind, feed, site, fetches):
        # links: fed key's index -> the fetch of the step before whose value it is fed
        lazy = lazy_lib.Lazy
        links = {i: self._carried_from(kind, v) for i, v in enumerate(feed)
                 if type(v) is lazy} if kind.keys else {}
        pending = self.pending
        if pending is not None and pending.kind is not kind:
            self.flush(f"a step run of another program at {site}")
            pending = None
        elif pending is not None and (
                any(i not in links and _shape(v) != pending.shapes[i]
                    for i, v in enumerate(feed))
                or (len(pending.records) > 1 and links != pending.links)):
            self.flush(f"a change of what the step is fed at {site}")
            pending = None
        if pending is None:
            feed = [lazy_lib.value(v) for v in feed]  # (a value of a step that just ran)
            pending = self.pending = _Pending(self.session, kind, [], {},
                                              [_shape(v) for v in feed])
        elif len(pending.records) == 1:
            pending.links = links
        record = _Record(self, feed, site, self.calls)
        pending.records.append(record)
        kind.last_feed = feed  # (a step's feed of each program: tests compare its kernels)
        values = [None] * len(kind.flat)
        lazies = record.lazies = []
        for j in kind.tensors:  # (a fetched op's value is None)
            values[j] = value = lazy(fetch=(record, j), type_=kind.types[j])
            lazies.append((j, value))
        if len(pending.records) == self.steps:
            self.flush()
        return _pack(fetches, iter(values))

    # -- a compiled run ----------------------------------------------------------------

    def _program(self, kind, links, count):
        """The compiled program of ``kind`` carrying ``links`` (compiled once); in
        unrolled mode, one for each run length ``count`` (N copies make N steps)."""
        steps = self.steps if self.mode == "while_loop" else count
        key = (kind.name, tuple(sorted(links.items()))) + ((steps,) if steps != self.steps
                                                            else ())
        program = self.programs.get(key)
        if program is None:
            start = time.perf_counter()
            graph = self.session.graph
            finalized = graph.finalized
            if finalized:
                graph._unsafe_unfinalize()  # noqa: SLF001 (a MonitoredSession finalizes)
            try:
                with graph.as_default():
                    program = compile_program(
                        list(kind.flat), steps, mode=self.mode, xla=self.xla,
                        carry={kind.keys[i]: kind.flat[j] for i, j in links.items()} or None,
                        name=f"deferred_{len(self.programs) + 1}", tripwires=False)
            finally:
                if finalized:
                    graph.finalize()
                self.build_seconds += time.perf_counter() - start
            self.programs[key] = program
            self.unrun.add(id(program))
            for op in kind.reached:  # the originals the program copies, watched at barriers
                effect = tripwires_lib.effect_of(op)
                if effect is not None and op.name in program._copied:  # noqa: SLF001
                    self.guarded.setdefault(op, (program.name, effect))
        return program

    def _run_pending(self, pending):
        kind, records, links = pending.kind, pending.records, pending.links
        built = self.build_seconds
        computed = [i for i in kind.computed if i not in links]
        if computed and len(records) == 1:  # one step: a program that carries them takes it
            links = next((dict(key[1]) for key in self.programs
                          if key[0] == kind.name and set(computed) <= set(dict(key[1]))), links)
            computed = [i for i in computed if i not in links]
        if not computed:
            try:
                program = self._program(kind, links, len(records))
            except (ValueError, NotImplementedError) as refusal:  # ms.compile refuses the
                # step: it runs as written, and the report says why
                kind.direct = (f"ms.compile refuses this step: "
                               f"{_first_sentences(str(refusal))}")
                computed = [None]
        if computed:  # the steps one at a time, as written
            reason = (kind.direct if kind.direct is not None else
                      f"{kind.keys[computed[0]].name} is fed and not carried (not a value of "
                      f"the step before it)")
            for i, record in enumerate(records):
                self.direct[f"{reason} (the run at {record.site})"] += 1
                try:
                    values = self._raw(kind.flat, dict(zip(kind.keys, record.feed)), None, None)
                except tf.errors.OpError as error:
                    self._failed(kind, records[i:], error, None, 0)
                self._settle([record], kind, values, None)
            return
        first = records[0].feed
        kept = [i for i in range(len(kind.keys)) if i in links or i not in kind.unread]
        # keyed by name where it can be (a string hashes faster than a tensor); carried:
        # step 1's value, the program follows it
        keys = kind.keys if any(isinstance(k, tf.SparseTensor) for k in kind.keys) else [
            k.name for k in kind.keys]
        feeds = [{keys[i]: first[i] if i in links else record.feed[i] for i in kept}
                 for record in records]
        self.local.depth = getattr(self.local, "depth", 0) + 1
        first, start = id(program) in self.unrun, time.perf_counter()
        self.unrun.discard(id(program))
        failed = True
        try:
            values = program.run(self.session, feeds=feeds)
            failed = False
        except (InputExhaustedError, StepFailedError) as error:
            self._failed(kind, records, error, error.values, self._done(program, error))
        except tf.errors.OpError as error:
            self._failed(kind, records, error, None, self._done(program, error))
        else:
            self.stats_runs += 1
            self.stats_steps += len(records)
            self._settle(records, kind, values, len(records))
        finally:
            elapsed = time.perf_counter() - start
            if first:
                self.build_seconds += elapsed
                payback.built(self.build_seconds - built, len(kind.reached))
                kind.timing.fused_seconds = 0.0  # (its steps' deferral: timed from here)
            elif not failed:
                self._compare(kind, elapsed, len(records))
            self.local.depth -= 1
            lazy_lib.settle_waiting()

    def _compare(self, kind, seconds, steps):
        """A compiled run of ``kind`` took ``seconds`` for ``steps``: where its fused
        steps prove no faster than its steps as written, they run as written from now on."""
        timing = kind.timing
        timing.fused_seconds += seconds
        timing.fused_steps += steps
        if self.fuse == "when_it_pays" and kind.direct is None and timing.fused_is_slower():
            kind.direct = (f"fusing it did not pay: a fused step took "
                           f"{timing.fused_seconds / timing.fused_steps * 1e6:.0f} µs, a "
                           f"step as written {timing.written_step * 1e6:.0f} µs: it runs as "
                           f"written")

    def _settle(self, records, kind, values, count):
        """Resolves the first ``count`` of ``records`` from a run's values (``count``
        None: one record, from a single step's values)."""
        flat = list(values)
        if count is None:
            records[0].values, records[0].done = flat, True
            return
        for i, record in enumerate(records[:count]):
            record.values = [None if v is None else _step_value(v, i) for v in flat]
            record.done = True

    def _done(self, program, error):
        """The steps the last run of ``program`` applied before ``error``: loop mode
        counts them; in unrolled mode the failing op's name says its copy, step k (the
        copies before it are applied); else 0."""
        done = getattr(program._run_length, "done", None)  # noqa: SLF001
        if done is not None:
            return int(self._raw(done, None, None, None))
        failed = getattr(error.op, "name", None) or error.message
        where = re.search(rf"{re.escape(program.name)}/step_(\d+)/", failed)
        return int(where.group(1)) - 1 if where else 0

    def _failed(self, kind, records, error, values, applied):
        applied = min(applied, len(records) - 1)  # (an error after the last step: its own)
        if applied:
            self.stats_runs += 1
            self.stats_steps += applied
            if values is not None:
                self._settle(records, kind, values, applied)
            else:  # (the program keeps no values: fetches of ops only, or unrolled mode)
                for record in records[:applied]:
                    record.values = [None] * len(kind.flat)
                    record.done = True
        failing, later = records[applied], len(records) - applied - 1
        cause = error.__cause__ if isinstance(error, (InputExhaustedError, StepFailedError)) \
            else error
        message = (f"{cause.message}\nmultistep.deferred: the step deferred by the run call "
                   f"at {failing.site} (run call {failing.call}) failed"
                   + (f"; the {applied} steps before it in its compiled run were applied"
                      if applied else "")
                   + (f". The loop made {later} more step run calls before it surfaced; "
                      f"their steps were not applied." if later else "."))
        raised = type(cause)(cause.node_def, cause.op, message)
        for record in records[applied:]:
            record.error, record.done = raised, True
        if later:
            warnings.warn(
                f"multistep.deferred: a deferred step failed ({type(cause).__name__}) "
                f"after the loop's Python ran {later} run calls past it (the last at "
                f"{records[-1].site}); their steps were not applied, but what the loop did "
                f"between them (counters, logs) was done: it may differ from the program "
                f"as written.", RuntimeWarning, stacklevel=graph_lib.user_stacklevel())
        raise raised from error


_NOT_PAID_YET = ("run as written while its program's build would not pay back yet "
                 "(fuse='when_it_pays': multistep.loops.payback)")


def _step_value(stacked, i):
    """Step ``i``'s value of a fetch, as ``Session.run`` returns it for that step."""
    if isinstance(stacked, list):  # (a fetch whose shape differed between the steps)
        return stacked[i]
    item = stacked[i]
    return item.copy() if isinstance(item, np.ndarray) else item


def _classify(graph, fetches, feed_dict):
    """What a run of ``fetches`` with ``feed_dict``'s keys is (``_Kind``)."""
    flat = [graph.as_graph_element(f) for f in flatten_fetches(fetches)]
    replaced = streams_lib.replaced(graph)
    remapped = bool(replaced) and any(isinstance(f, tf.Tensor) and f.ref() in replaced
                                      for f in flat)
    if remapped:  # a fetch of a random op's own output: its shared stream's draw
        flat = [replaced.get(f.ref(), f) if isinstance(f, tf.Tensor) else f for f in flat]
    keys = tuple(_graph_keys(graph, feed_dict))
    reached = graph_lib.ancestors([getattr(f, "op", f) for f in flat])
    step = any(op.type.startswith(_APPLY_PREFIXES) for op in reached) or (
        any(graph_lib.is_write(op) for op in reached)
        and any("gradients" in op.name.split("/") for op in reached))
    keys = tuple(sorted(keys, key=_key_name))  # (the order of a feed dict's keys: not a kind)
    name = (_structure_key(fetches, leaf=lambda f: graph.as_graph_element(f).name),
            tuple(_key_name(k) for k in keys))
    read = [isinstance(k, tf.SparseTensor) or k.op in reached for k in keys]
    computed = tuple(i for i, k in enumerate(keys) if read[i] and not _is_placeholder(k))
    unread = frozenset(i for i, k in enumerate(keys) if not read[i])
    kind = _Kind(step, flat, keys, frozenset(reached), name, computed, unread, remapped)
    kind.direct = _as_written(reached) if step else None
    kind.fails = _fails(reached) if step else None
    kind.types = [_returned_type(f) for f in flat]
    kind.tensors = [j for j, f in enumerate(flat) if not isinstance(f, tf.Operation)]
    return kind


# Ops that fail on what a step finds when it runs (the input's end, a check), by the error.
_INPUT_END, _CHECK = ("the input's end", "OutOfRangeError"), ("a check", "InvalidArgumentError")
_FAILING_OPS = {"IteratorGetNext": _INPUT_END, "IteratorGetNextSync": _INPUT_END,
                "Assert": _CHECK, "CheckNumerics": _CHECK, "CheckNumericsV2": _CHECK}


def _fails(reached):
    """(the first op of ``reached`` that can fail, said; the errors such ops raise), or
    None."""
    failing = sorted((op.name, op.type) for op in reached if op.type in _FAILING_OPS)
    if not failing:
        return None
    name, op_type = failing[0]
    errors = tuple({getattr(tf.errors, _FAILING_OPS[t][1]) for _, t in failing})
    return f"{_FAILING_OPS[op_type][0]} at {name!r}", errors


def _returned_type(fetch):
    """The type ``Session.run`` returns for ``fetch``, known from its dtype and rank (a
    scalar's numpy type, ``bytes``, ``np.ndarray``), or None."""
    if not isinstance(fetch, tf.Tensor) or fetch.shape.rank is None:
        return None
    if fetch.dtype == tf.string:
        return bytes if fetch.shape.rank == 0 else np.ndarray
    if not fetch.dtype.is_numpy_compatible or fetch.dtype in (tf.resource, tf.variant):
        return None
    return fetch.dtype.as_numpy_dtype if fetch.shape.rank == 0 else np.ndarray


# A step that calls Python: its Python must run when the loop's does (it may read what the
# loop set before the run).
_PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def _as_written(reached):
    """Why a step that reaches ``reached`` must run as written, one at a time (or None)."""
    python = sorted(f"{op.name!r} ({op.type}){graph_lib.built_at(op)}" for op in reached
                    if op.type in _PYTHON_OPS)
    if python:
        return (f"the step calls Python ({python[0]}), which must run when the loop's "
                f"Python does")
    prints = sorted(f"{op.name!r}{graph_lib.built_at(op)}" for op in reached
                    if op.type in ("PrintV2", "Print"))
    if prints:
        return (f"the step prints ({prints[0]}): its lines come when the loop's own "
                f"output does")
    queues = sorted(f"{op.name!r}{graph_lib.built_at(op)}" for op in reached
                    if op.type.startswith("QueueDequeue"))
    if queues:
        return (f"the step dequeues from a queue ({queues[0]}) that threads fill: each step "
                f"takes what the queue holds when the loop runs it")
    return None


def _first_sentences(text, most=400):
    """``text`` cut after the sentence that passes ``most`` characters."""
    end = text.find(". ", most)
    return text if end < 0 else text[:end + 1]


def _graph_keys(graph, feed_dict):
    """The fed keys of ``feed_dict`` as graph elements, in its order."""
    return [k if isinstance(k, tf.SparseTensor) else graph.as_graph_element(k)
            for k in (feed_dict or ())]


def _key_name(key):
    return repr([t.name for t in (key.indices, key.values, key.dense_shape)]) \
        if isinstance(key, tf.SparseTensor) else key.name


def _is_placeholder(key):
    return isinstance(key, tf.SparseTensor) or key.op.type in (*PLACEHOLDERS,
                                                                "PlaceholderWithDefault")


_LEAVES = set()  # types seen as leaves of a fetch structure (a tensor's, an op's)


def _structure_key(fetches, leaf=id):
    """A key of the fetches' structure and leaves (by ``leaf``: their ids, or names)."""
    kind = type(fetches)
    if kind is list and all(type(v) in _LEAVES for v in fetches):  # (the common case)
        return (list, *map(leaf, fetches))
    if kind in _LEAVES:
        return leaf(fetches)
    if isinstance(fetches, dict):
        return type(fetches), tuple((k, _structure_key(v, leaf)) for k, v in fetches.items())
    if isinstance(fetches, (list, tuple)):
        return (type(fetches),) + tuple(_structure_key(v, leaf) for v in fetches)
    _LEAVES.add(kind)
    return leaf(fetches)


def flatten_fetches(fetches, out=None):
    """The leaves of ``fetches`` in ``Session.run``'s order (a dict's in its own order: its
    keys need not compare, as a MonitoredSession's hook-keyed fetches do not)."""
    out = [] if out is None else out
    if isinstance(fetches, dict):
        for value in fetches.values():
            flatten_fetches(value, out)
    elif isinstance(fetches, (list, tuple)):
        for value in fetches:
            flatten_fetches(value, out)
    else:
        out.append(fetches)
    return out


def _shape(value):
    return value.shape if isinstance(value, (np.ndarray, np.generic)) else np.shape(value)


def _pack(fetches, leaves):
    """``leaves`` in the structure of ``fetches``, as ``Session.run`` returns it."""
    if type(fetches) is list:  # (the common case, a list of tensors and ops)
        return [_pack(v, leaves) if isinstance(v, (list, tuple, dict)) else next(leaves)
                for v in fetches]
    if isinstance(fetches, dict):
        out = (type(fetches)(fetches.default_factory)
               if isinstance(fetches, collections.defaultdict) else type(fetches)())
        for key, value in fetches.items():
            out[key] = _pack(value, leaves)
        return out
    if isinstance(fetches, tuple) and hasattr(fetches, "_fields"):
        return type(fetches)(*[_pack(v, leaves) for v in fetches])
    if isinstance(fetches, (list, tuple)):
        return type(fetches)(_pack(v, leaves) for v in fetches)
    return next(leaves)


def _forced(feed_dict):
    """``feed_dict`` with each lazy value forced (its steps run)."""
    lazy = lazy_lib.Lazy  # (a type check: isinstance of a Lazy answers as its value's)
    if not feed_dict or not any(type(v) is lazy for v in feed_dict.values()):
        return feed_dict
    return {k: v._force() if type(v) is lazy else v  # noqa: SLF001
            for k, v in feed_dict.items()}


def _meaningful(options):
    return options is not None and options != config_pb2.RunOptions()


def _site():
    """``file:line`` of the user's line that led here: the first frame outside multistep,
    TensorFlow and numpy; where the call came through TensorFlow (a hook), that frame too."""
    return str(_Site())


class _Site:
    """Where the user's line that led here is (``_site``), said when it is formatted: a
    deferred step's own is rarely said, and the frame walk is the cheaper half."""

    __slots__ = ("here", "via")

    def __init__(self):
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
            frame = frame.f_back
        via = None
        while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS
                                                                        + (_OWN_DIR,)):
            if via is None and frame.f_code.co_filename.startswith(_TF_DIR):  # (a hook's)
                via = (frame.f_code, frame.f_lineno)
            frame = frame.f_back
        self.here = None if frame is None else (frame.f_code, frame.f_lineno)
        self.via = via

    def __str__(self):
        via = self.via and (f"{os.path.basename(self.via[0].co_filename)}:{self.via[1]} "
                            f"in {self.via[0].co_name}")
        if self.here is None:
            return via or "?"
        here = f"{os.path.basename(self.here[0].co_filename)}:{self.here[1]}"
        return f"{here} (via {via})" if via else here


# -- the session ---------------------------------------------------------------------------


class DeferredSession(session_lib.SessionInterface):
    """A ``tf.compat.v1.Session`` (or ``MonitoredSession``) whose step runs are deferred:
    what ``ms.deferred`` returns. It behaves as the session it wraps (``graph``, ``run``,
    ``close``, ``as_default()``, the context manager, ``make_callable`` as a barrier) and
    adds ``flush()`` and ``report()``."""

    def __init__(self, wrapped, engine):
        self._wrapped, self._engine = wrapped, engine
        self._default = None

    @property
    def graph(self):
        return self._wrapped.graph

    @property
    def sess_str(self):
        return getattr(self._wrapped, "sess_str", "")

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """As ``Session.run``; a step run is deferred and returns lazy values."""
        # (through BaseSession.run, patched: what wraps it, such as multistep verify's
        # recorder, sees the run as it sees the script's other runs)
        return self._wrapped.run(fetches, feed_dict=feed_dict, options=options,
                                 run_metadata=run_metadata)

    def flush(self):
        """Runs the pending steps now."""
        self._engine.flush(f"sess.flush() at {_site()}")

    def report(self):
        """The ``FusionReport``: steps made, compiled runs, and why runs were short."""
        return self._engine.report()

    def make_callable(self, fetches, feed_list=None, accept_options=False):
        """``Session.make_callable``, each call a barrier (the pending steps run first)."""
        return self._wrapped.make_callable(fetches, feed_list, accept_options)

    def partial_run_setup(self, fetches, feeds=None):
        """Refused: a partial run's later calls depend on its first."""
        raise NotImplementedError(
            "multistep.deferred: partial_run is not supported on a deferred session: a "
            "partial run's later calls depend on its first, which a deferred step run "
            "cannot order. Run it on a session that is not deferred.")

    def partial_run(self, handle, fetches, feed_dict=None):
        """Refused, as ``partial_run_setup``."""
        self.partial_run_setup(fetches)

    def as_default(self):
        """This session as the default session (``tensor.eval()``, ``op.run()``)."""
        from tensorflow.python.framework import stack

        return stack.default_session(self)

    def close(self):
        """Runs the pending steps, then closes the session."""
        try:
            self._engine.close()
        finally:
            self._wrapped.close()

    def __enter__(self):
        self._default = (self.graph.as_default(), self.as_default())
        for manager in self._default:
            manager.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if not hasattr(self._wrapped, "_close_internal"):
                self.close()
                return None
            # a MonitoredSession: the pending steps first, then its own exit, which takes
            # the input's end (OutOfRangeError), raised in the with or by those steps, as
            # the end of training (its hooks' end() run, nothing raised), as written
            try:
                self._engine.close()
            except tf.errors.OutOfRangeError as error:
                exc = exc if exc[0] is not None else (type(error), error, error.__traceback__)
            except BaseException as error:
                self._wrapped.__exit__(type(error), error, error.__traceback__)
                raise
            return self._wrapped.__exit__(*exc)
        finally:
            for manager in reversed(self._default or ()):
                manager.__exit__(None, None, None)
            self._default = None

    def __getattr__(self, name):
        return getattr(self._wrapped, name)


FUSE = ("when_it_pays", "at_once")


def deferred(session, steps, *, mode="while_loop", xla=False, report=False,
             fuse="when_it_pays"):
    """``session`` with its training steps run ``steps`` at a time, bitwise as the loop
    as written runs them one a call.

    Args:
      session: a ``tf.compat.v1.Session`` (or ``InteractiveSession``), or a
        ``MonitoredSession``/``MonitoredTrainingSession`` (its own session is deferred;
        its hooks see each run, and a hook that reads a value forces the pending steps).
      steps: N >= 1, the most steps of one compiled run.
      mode: ``"while_loop"`` (runs of fewer than N steps share one program) or
        ``"unrolled"``.
      xla: compile the steps with XLA (bitwise with the step compiled alone by XLA, not
        with the plain step: see ``ms.compile``).
      report: print the report's first line (steps, compiled runs) to stderr on close.
      fuse: ``"when_it_pays"`` (a program's steps run as written, timed, until its
        build would pay back in the steps left, and again if its fused steps prove no
        faster: ``multistep.loops.payback``) or ``"at_once"`` (fused from the first
        step, whatever the loop's length).

    Returns:
      A ``DeferredSession``: use it where the loop used ``session``.

    Example:
      >>> import numpy as np, tensorflow as tf, multistep as ms
      >>> graph = tf.Graph()
      >>> with graph.as_default():
      ...     x = tf.compat.v1.placeholder(tf.float32, [None, 2])
      ...     w = tf.Variable(tf.ones([2, 1]))
      ...     loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
      ...     train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
      ...     init = tf.compat.v1.global_variables_initializer()
      >>> sess = ms.deferred(tf.compat.v1.Session(graph=graph), steps=4, fuse="at_once")
      >>> _ = sess.run(init)
      >>> total = 0.0
      >>> for i in range(8):
      ...     _, l = sess.run([train, loss], {x: np.full([3, 2], 0.5, np.float32)})
      ...     total += l                    # stays lazy
      >>> print(f"{total:.4f}")             # a read: runs what is pending
      4.2879
      >>> sess.report().runs
      2
      >>> sess.close()
    """
    if isinstance(session, DeferredSession):
        raise ValueError("ms.deferred: the session is deferred already (ms.deferred of a "
                         "DeferredSession); defer a session once.")
    if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ms.deferred: steps must be a positive int, got {steps!r}.")
    if mode not in ("while_loop", "unrolled"):
        raise ValueError(f"ms.deferred: mode must be 'while_loop' or 'unrolled', got {mode!r}.")
    if fuse not in FUSE:
        raise ValueError(f"ms.deferred: fuse must be 'when_it_pays' or 'at_once', got "
                         f"{fuse!r}.")
    if not isinstance(xla, bool) or not isinstance(report, bool):
        raise TypeError(f"ms.deferred: xla and report must be True or False, got "
                        f"{xla!r} and {report!r}.")
    raw = _raw_session(session)
    if raw is None:
        raise TypeError(f"ms.deferred takes a tf.compat.v1.Session or a MonitoredSession, "
                        f"got {type(session).__name__}.")
    if getattr(raw, "_closed", False):
        raise RuntimeError("ms.deferred: the session is closed.")
    if raw in _ENGINES and not _ENGINES[raw].auto:
        raise ValueError("ms.deferred: the session is deferred already; defer a session "
                         "once.")
    if _AUTO:  # multistep run on a script that defers its own session: the script's wins
        previous = _ENGINES.pop(raw, None)
        if previous is not None:
            previous.flush(f"ms.deferred at {_site()}")
            previous.closed = True
        print(f"multistep run: the script defers this session itself (ms.deferred at "
              f"{_site()}): its own steps={steps} are used.", file=sys.stderr)
    _install()
    streams_lib.streams_of(raw.graph)  # (its random ops: one stream each, where no run holds them)
    engine = _ENGINES[raw] = _Engine(raw, int(steps), mode, xla, report, fuse)
    return DeferredSession(session, engine)


def _raw_session(session):
    if isinstance(session, session_lib.BaseSession):
        return session
    inner = getattr(session, "_tf_sess", None)  # a MonitoredSession's own session
    if callable(inner):
        try:
            return inner()
        except Exception:  # noqa: BLE001 (a closed or broken monitored session)
            return None
    return None


def defer_every_session(steps, *, mode="while_loop", xla=False, fuse="when_it_pays"):
    """``multistep run``: every ``tf.compat.v1.Session`` made from now on is deferred."""
    _install()
    _session_hook.every_graph(streams_lib.streams_of)  # (each graph's random ops: one stream)
    _AUTO.update(steps=steps, mode=mode, xla=xla, fuse=fuse)


def reports():
    """The report of each session deferred in this process, in the order they were."""
    return [engine.report() for engine in _ALL]


def flush_all(cause="interpreter exit"):
    """Runs every session's pending steps (interpreter exit, ``multistep run``'s end)."""
    for engine in list(_ALL):
        if not engine.closed and engine.pending is not None:
            engine.flush(cause)


# -- the one patch: BaseSession's run, make_callable and close -------------------------------


def _engine_of(session):
    engine = _ENGINES.get(session)
    if engine is None and _AUTO and not getattr(session, "_closed", False):
        engine = _ENGINES[session] = _Engine(session, _AUTO["steps"], _AUTO["mode"],
                                             _AUTO["xla"], fuse=_AUTO["fuse"])
        engine.auto = True
        # the script's loop is the main thread's, whichever thread ran the session first
        # (a Supervisor's or a queue runner's)
        engine.owner = threading.main_thread().ident
    return engine


def _run(self, fetches, feed_dict=None, options=None, run_metadata=None):
    engine = _engine_of(self)
    if engine is None or not engine.bypassing():
        return (_ORIGINAL["run"](self, fetches, feed_dict, options, run_metadata)
                if engine is None else engine.run(fetches, feed_dict, options, run_metadata))
    if (getattr(engine.local, "depth", 0) == 0 and not engine.closed
            and engine.pending is not None):  # another thread's run: it sees the loop's steps
        engine.flush(f"a run from another thread at {_site()}")
    return _ORIGINAL["run"](self, fetches, feed_dict, options, run_metadata)


def _barrier_callable(session, call):
    """``call`` (a callable of ``session``), its calls barriers of a deferred session."""
    engine = _ENGINES.get(session)
    if engine is None:
        return call

    def barrier(*args, **kwargs):
        if not engine.bypassing():
            engine.flush(f"a make_callable call at {_site()}")
        return call(*args, **kwargs)

    return barrier


def _make_callable(self, fetches, feed_list=None, accept_options=False):
    return _barrier_callable(self, _ORIGINAL["make_callable"](self, fetches, feed_list,
                                                               accept_options))


def _make_callable_from_options(self, callable_options):  # (tf-keras's v1 functions')
    return _barrier_callable(self, _ORIGINAL["_make_callable_from_options"](
        self, callable_options))


def _close(self):
    engine = _ENGINES.get(self)
    try:
        if engine is not None and not engine.closed:
            engine.close()
    finally:
        _ORIGINAL["close"](self)


def _partial_run_setup(self, fetches, feeds=None):
    if _ENGINES.get(self) is not None:
        DeferredSession.partial_run_setup(None, fetches, feeds)
    return _ORIGINAL["partial_run_setup"](self, fetches, feeds)


# A summary written with a lazy value (``writer.add_summary(summary, step)``): written
# when the value is known, in the order the loop asked; the writer's flush and close, and
# a write of a known value to the same writer, run the ones pending first.


def _add_summary(self, summary, global_step=None):
    if lazy_lib.is_pending(summary) or lazy_lib.is_pending(global_step):
        lazy_lib.effect(self, _ORIGINAL["add_summary"], self, summary, global_step)
        return None
    lazy_lib.run_effects(self)
    return _ORIGINAL["add_summary"](self, lazy_lib.value(summary), lazy_lib.value(global_step))


def _writer_flush(self):
    lazy_lib.run_effects(self)
    return _ORIGINAL["writer_flush"](self)


def _writer_close(self):
    lazy_lib.run_effects(self)
    return _ORIGINAL["writer_close"](self)


def _install():
    if _ORIGINAL:
        return
    from tensorflow.python.summary.writer import writer as writer_lib

    for owner, name, key, patched in [
            (session_lib.BaseSession, "run", "run", _run),
            (session_lib.BaseSession, "make_callable", "make_callable", _make_callable),
            (session_lib.BaseSession, "_make_callable_from_options",
             "_make_callable_from_options", _make_callable_from_options),
            (session_lib.BaseSession, "close", "close", _close),
            (session_lib.BaseSession, "partial_run_setup", "partial_run_setup",
             _partial_run_setup),
            (writer_lib.SummaryToEventTransformer, "add_summary", "add_summary", _add_summary),
            (writer_lib.FileWriter, "flush", "writer_flush", _writer_flush),
            (writer_lib.FileWriter, "close", "writer_close", _writer_close)]:
        _ORIGINAL[key] = getattr(owner, name)
        setattr(owner, name, patched)
    atexit.register(flush_all)
    _ORIGINAL["os._exit"] = os._exit
    os._exit = _exit  # (atexit does not run at os._exit)


def _exit(status):
    """``os._exit``: the pending steps run first (as written they ran before it)."""
    try:
        flush_all(f"os._exit at {_site()}")
    except BaseException:  # noqa: BLE001 (a failed step: the exit goes on, as written)
        pass
    _ORIGINAL["os._exit"](status)
