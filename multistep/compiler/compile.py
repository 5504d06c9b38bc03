"""The compiler: the single step the user built, run N times in one ``sess.run``.

``compile(fetches, steps=N)`` takes what a training loop fetches every step (the train
op, the loss, the summaries) and copies the subgraph they depend on, with the state
shared: N copies, each ordered after the previous one (``mode="unrolled"``), or one copy
as the body of a ``tf.while_loop`` run N times (``mode="while_loop"``). Step k reads the
weights step k-1 wrote and recomputes its loss and gradients from them, as the k-th of N
single ``sess.run`` calls would.

The pieces, one a file: ``placement`` (the rule: which ops the copies share, which
become per-step inputs, which each copy owns), ``copy`` (the step's ops as a template,
imported once per copy), ``feeds`` (a run's feed from the program's own), ``runs`` (what
a run returns and raises), and here the modes (N copies, or one loop body), the run
length, and ``Compiled``, what a program's loop runs.
"""

import collections
import dataclasses
import numbers
import re
import warnings
import weakref

import tensorflow as tf
from tensorflow.python.ops import gen_lookup_ops  # the run length's table

from multistep import graph as graph_lib
from multistep.compiler import xla as xla_lib
from multistep.compiler import tripwires as tripwires_lib
from multistep.compiler import kernels as kernels_lib
from multistep.compiler import streams as streams_lib
from multistep.compiler import feeds as feeds_lib
from multistep.compiler.feeds import per_step_input, per_step_placeholders, prepared
from multistep.compiler.copy import (MOST_KEYED_COPIES, fetched_in, import_copies, state_fetches,
                                     template_of)
from multistep.compiler.placement import STATE_OWNERS, placement
from multistep.compiler.runs import (PLAIN_SESSIONS, InputExhaustedError, StepFailedError,
                                     callable_for, exhausted_message, failed_message,
                                     per_step_values)

__all__ = ["COMPILE_MODES", "Compiled", "GraphTooLargeError", "InputExhaustedError",
           "STATE_OWNERS", "StepFailedError", "compile", "placement"]

COMPILE_MODES = ("while_loop", "unrolled", "auto")

_CHECKS = frozenset({"Assert", "CheckNumerics", "CheckNumericsV2"})  # may fail at any step
_FUNCTIONAL_CONTROL_FLOW = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case",
                                      "StatelessCase"})


MOST_LOOP_STEPS = 2 ** 31 - 1  # a loop counts its steps in int32
GRAPHDEF_LIMIT = 2 ** 31  # bytes: protobuf's limit on a serialized GraphDef


class GraphTooLargeError(ValueError):
    """An unrolled graph would pass the 2 GB GraphDef limit."""


def set_steps_per_run(program, session, n):
    """``program.set_steps_per_run`` (an ``Unrolled`` or ``ms.compile``'s ``Compiled``):
    from the next run on, a run of loop mode makes ``n`` steps, ``1 <= n <= steps``."""
    if program._run_length is None:
        raise TypeError(
            f"{program.name}: set_steps_per_run needs mode='while_loop'; in mode='unrolled' "
            f"the graph holds exactly {program.steps} copies of the step, so every run makes "
            f"{program.steps} steps. Build with mode='while_loop' (graph size independent of "
            f"N) to vary the run length without a rebuild.")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{program.name}: steps per run must be an int, got {n!r} "
                        f"({type(n).__name__}).")
    if not 1 <= n <= program.steps:
        raise ValueError(
            f"{program.name}: steps per run must be in 1..{program.steps} (the most a run was "
            f"built for: steps={program.steps}), got {n}.")
    session.run(program._run_length.assign, {program._run_length.value: int(n)})


_RunLength = collections.namedtuple("_RunLength", "value assign read done")


def make_run_length(steps, *, count_done):
    """Loop mode's run length, built with the graph (a finalized graph takes no new op):
    a one-entry hash table, which needs no initialiser (a new session, or one that ran
    only ``global_variables_initializer``, reads its default ``steps``), a feed and an
    insert op that set it, and ``read``, what the loop reads (``steps_per_run``: a
    scalar int32 tensor). No checkpoint holds it and no variable reset touches it. (It
    was a variable read through a ``tf.cond`` on whether it was initialised: 6 host
    nodes, 1.22 against 1.16 µs a step on blobs at N = 100.) With ``count_done`` (a
    tf.data input, a queue, a check that can fail at any step), also a local variable
    the loop sets to the steps ended so far in a run, for the message of the error that
    stops a run midway."""
    local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
    with tf.compat.v1.name_scope("steps_per_run") as scope:
        table = gen_lookup_ops.mutable_hash_table_v2(  # (a resource of each session)
            key_dtype=tf.int32, value_dtype=tf.int32, use_node_name_sharing=True,
            name="table")
        value = tf.compat.v1.placeholder(tf.int32, [], name="value")
        assign = gen_lookup_ops.lookup_table_insert_v2(table, [0], [value], name="set")
        read = gen_lookup_ops.lookup_table_find_v2(table, 0, steps, name=scope)
        read.set_shape([])
    done = None
    if count_done:
        done = tf.compat.v1.Variable(0, dtype=tf.int32, trainable=False, use_resource=True,
                                     collections=local, name="steps_done")
    return _RunLength(value, assign, read, done)


def positive_int(what, value):
    """``value`` as an int, if it is an integer >= 1; else a TypeError or ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int >= 1, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value}.")
    return int(value)


def _ancestors_in_order(roots):
    """Every op ``roots`` depend on (through inputs and control inputs), in the order the
    graph holds them (its creation order)."""
    seen = graph_lib.ancestors(roots)
    return sorted(seen, key=lambda op: op._id)  # noqa: SLF001 (creation order)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """The compiled N-step program: run ``train_op`` (or ``run``) once for N steps.

    Attributes:
      train_op: running it runs every step.
      values: the fetches' structure, each tensor fetch now its N steps' values
        (``[N, ...]``; loop mode ``[steps_per_run, ...]``), each op fetch ``train_op``;
        a fetched ``SparseTensor`` or ``IndexedSlices`` has each component so stacked.
        A fetch with a dimension of unknown size (one whose shape can differ between
        steps: a short final batch) is a ``RaggedTensor`` ``[N, (d1), ...]``; ``run``
        returns it as ``[N, ...]`` where the steps' shapes agree, else one array a step.
        A fetch of state (a variable, an ``assign_add``'s ref) is its value at each
        step's end, as a single step's ``sess.run`` returns it. Fetching any of them
        runs the steps once.
      losses: float32 ``[N]``: the values of the fetch that is the loss (the one keyed
        ``"loss"`` in a dict, else the only float scalar tensor fetched that a variable's
        gradient flows from: an accuracy is no loss), or None.
      inputs: original placeholder -> the ``[steps, ...]`` placeholder that feeds it
        slice k at step k.
      carry, carry_in: with ``carry=``, lists: the carried tensors' values after the
        run's last step, and the tensors each run starts from (fed as the program's own
        loop feeds them).
      step_increment: what a step adds to the global step (the constants of its
        ``assign_add``s), or None where the build cannot tell (``StopAtStepHook``
        measures it at the first run).
      steps, name, mode, global_step, steps_per_run: as ``ms.Unrolled``'s.
    """

    train_op: tf.Operation
    values: object
    losses: object
    inputs: dict
    steps: int
    name: str
    mode: str
    global_step: object = None
    steps_per_run: object = None
    records: dict = dataclasses.field(default_factory=dict)
    summaries: object = None
    why: object = None
    carry: object = None
    carry_in: object = None
    step_increment: object = 1
    _run_length: object = dataclasses.field(default=None, repr=False)
    _by_name: dict = dataclasses.field(default_factory=dict, repr=False)
    _copied: frozenset = dataclasses.field(default=frozenset(), repr=False)  # op names
    _reads: frozenset = dataclasses.field(default=frozenset(), repr=False)  # placeholders read
    _roots: tuple = dataclasses.field(default=(), repr=False)  # the original fetches, flat
    _finals: dict = dataclasses.field(default_factory=dict, repr=False)  # carry=, as given
    _loss_index: object = dataclasses.field(default=None, repr=False)  # the loss's, in _roots
    _dynamic: dict = dataclasses.field(default_factory=dict, repr=False)  # id: static shape
    _partial: dict = dataclasses.field(default_factory=dict, repr=False)  # id: steps' values
    _started: object = dataclasses.field(default=None, repr=False)  # global step at run start
    _callables: object = dataclasses.field(default_factory=weakref.WeakKeyDictionary,
                                           repr=False, compare=False)

    def feed_dict(self, feed_dict=None, *, feeds=None):
        """The compiled program's feed for one run, from what the program's loop feeds.

        Args:
          feed_dict: the original placeholders (or their names) as keys; a per-step
            input's value is ``[n, ...]`` (one slice a step) or the placeholder's own
            shape (the same value every step; a scalar for a placeholder of no shape).
          feeds: instead, the run's single-step feed dicts in step order, one a step, as
            the program's own loop builds them (loop mode: a run of ``len(feeds)``
            steps). A carried placeholder's value is taken from ``feeds[0]``.
        """
        return feeds_lib.translate(self, feed_dict, feeds)

    def run(self, session, feed_dict=None, *, feeds=None):
        """Runs the steps once; returns the per-step values of the fetches (numpy):
        ``[N, ...]`` each, or for a fetch whose shape differed between the run's steps (a
        short final batch) a list of N arrays, as N ``sess.run`` calls return them.

        ``feed_dict`` or ``feeds`` as ``Compiled.feed_dict`` takes them. Without a feed,
        on a plain ``Session``, through a callable made once per session
        (``Session.make_callable``), as ``ms.Unrolled.run``; else ``session.run`` (a
        ``MonitoredSession``'s hooks must see each run).

        If a ``tf.data`` input (or a queue) runs out in the middle of the run, the steps
        before stay applied and ``InputExhaustedError`` says how many (and, in loop mode,
        holds their values: ``error.values``); a check that fails at some step of the
        loop (an ``Assert``, a ``check_numerics``) raises ``StepFailedError``, saying so
        too. In a ``MonitoredSession`` the error is TensorFlow's, unchanged (it ends
        training cleanly on an ``OutOfRangeError``): ``ms.hooks.InputExhaustedHook``
        reports the run."""
        _check_run_arguments(self, session, feed_dict, feeds)
        if not isinstance(session, PLAIN_SESSIONS):
            _refuse_one_step_hooks(self, session)
        feed = self.feed_dict(feed_dict, feeds=feeds)
        try:
            if feed or not isinstance(session, PLAIN_SESSIONS):
                values = session.run(self.values, feed)
            else:
                values = callable_for(self._callables, session, self.values)[0]()
        except (tf.errors.OutOfRangeError, tf.errors.InvalidArgumentError) as error:
            if not isinstance(session, PLAIN_SESSIONS):  # a MonitoredSession ends cleanly on
                raise  # TensorFlow's own OutOfRangeError: ms.hooks.InputExhaustedHook reports
            if isinstance(error, tf.errors.OutOfRangeError):
                raise InputExhaustedError(exhausted_message(self, session, error), error,
                                          self._applied(session)) from error
            if not self._in_loop_body(error):
                raise  # (before the steps: a feed; unrolled mode: the op's name says the step)
            values = self._applied(session)
            raise StepFailedError(failed_message(self, session, error, values), error,
                                  values) from error
        if not self._dynamic:
            return values
        from tensorflow.python.util import nest  # (map_structure_up_to: not in tf.nest)
        return nest.map_structure_up_to(
            self.values, lambda fetch, value: per_step_values(value, self._dynamic[id(fetch)])
            if id(fetch) in self._dynamic else value, self.values, values)

    def set_steps_per_run(self, session, n):
        """From the next run on, a run makes ``n`` steps (``1 <= n <= steps``); loop
        mode only (as ``ms.Unrolled.set_steps_per_run``)."""
        set_steps_per_run(self, session, n)

    def _in_loop_body(self, error):
        """Whether ``error`` came from a step of this program's loop, which counts them."""
        if self._run_length is None or self._run_length.done is None:
            return False
        label = re.escape(self.name)
        if re.search(rf"{label}/loop/body/|{label.replace('/', '_')}_loop_body",
                     error.message) is not None:
            return True
        # TensorFlow's message may name only the node inside the body's function, the
        # step's copy of an original op: "{{node step/<original name>}}"
        nodes = re.findall(r"\{\{node step/([^}]+)\}\}", error.message)
        return any(node in self._copied for node in nodes)

    def _applied(self, session):
        """The values of the steps the last run ended (all of them, or those before the
        step that failed), as ``run`` returns a run's; None where the program keeps none
        (unrolled mode, XLA, a step that cannot stop midway)."""
        if not self._partial or self._run_length.done is None:
            return None
        applied, kept = session.run([self._run_length.done, self._partial])
        return tf.nest.map_structure(
            lambda fetch: kept[id(fetch)][:applied] if id(fetch) in kept else None,
            self.values)


def _check_run_arguments(program, session, feed_dict, feeds):
    """Refuses, naming the argument, what ``Compiled.run`` cannot take."""
    if not callable(getattr(session, "run", None)):
        raise TypeError(f"{program.name}: run(session, ...) takes a tf.compat.v1.Session (or a "
                        f"MonitoredSession) first, got {type(session).__name__}.")
    if feed_dict is not None and not isinstance(feed_dict, dict):
        raise TypeError(
            f"{program.name}: feed_dict must be a dict (placeholder -> value), got "
            f"{type(feed_dict).__name__}; the run's feed dicts one a step go in "
            f"feeds=[...].")
    if feeds is not None and (isinstance(feeds, dict) or not all(
            isinstance(f, dict) for f in feeds)):
        raise TypeError(f"{program.name}: feeds must be a list of feed dicts, one a step, "
                        f"got {type(feeds).__name__}" + (" (a dict: pass it as feed_dict)"
                                                         if isinstance(feeds, dict) else "")
                        + ".")
    for feed in [feed_dict or {}] + list(feeds or ()):
        for key, value in feed.items():
            if isinstance(value, (tf.Tensor, tf.Operation, tf.Variable)):
                raise TypeError(
                    f"{program.name}: the value fed to {getattr(key, 'name', key)!r} is a "
                    f"{type(value).__name__}; feed values are numbers and arrays (as "
                    f"Session.run takes them): run the tensor first, or feed its value.")


def _refuse_one_step_hooks(program, session):
    """Refuse, before a step runs, TensorFlow's hooks that count one step a ``sess.run``
    in a ``MonitoredSession`` running ``program``: its ``StopAtStepHook`` adds 1 to a read
    of the global step that the run's steps race, and stops up to a run late."""
    hooks = getattr(session, "_hooks", None) or []  # (MonitoredSession keeps its hooks there)
    if any(type(hook) is tf.compat.v1.train.StopAtStepHook for hook in hooks):
        raise ValueError(
            f"{program.name}: the session runs TensorFlow's StopAtStepHook, which counts "
            f"one step a sess.run (the global step read during the run, plus 1); a run of "
            f"{program.name} makes up to {program.steps} steps, so it would stop up to a run "
            f"late. Use ms.hooks.StopAtStepHook(fused, last_step=...) in its place (fused: "
            f"this program): it shortens the last run to stop exactly.")
    for hook in hooks:
        fed = sorted(_fed_placeholders(program, hook))
        if fed:
            raise ValueError(
                f"{program.name}: the session runs TensorFlow's {type(hook).__name__}, which "
                f"fetches the original step's tensors: they read placeholder(s) "
                f"{graph_lib.named_few(map(repr, fed))}, which a run of {program.name} feeds "
                f"per step under its own inputs, so the hook's fetch would fail (\"You must "
                f"feed a value for placeholder\") or run the original step beside the "
                f"compiled one. Give the hook the compiled per-step values: "
                f"NanTensorHook(tf.reduce_sum(fused.losses)) (a NaN in any step makes the "
                f"sum NaN), LoggingTensorHook({{'loss': fused.losses}}).")


def _fed_placeholders(program, hook):
    """The names of the placeholders ``program`` feeds per step (a run feeds their
    ``[N, ...]`` values to its own inputs) that ``hook`` (a ``NanTensorHook`` or
    ``LoggingTensorHook`` of TensorFlow's) reads through its tensors."""
    if isinstance(hook, tf.compat.v1.train.NanTensorHook):
        tensors = [hook._loss_tensor]  # noqa: SLF001
    elif isinstance(hook, tf.compat.v1.train.LoggingTensorHook):
        tensors = list(getattr(hook, "_tensors", {}).values())
    else:
        return set()
    graph = program.train_op.graph
    ops = [graph.as_graph_element(t).op if isinstance(t, str) else getattr(t, "op", t)
           for t in tensors]
    per_step = {original.op.name for original, _ in program._by_name.values()}  # noqa: SLF001
    return {op.name for op in graph_lib.ancestors(ops) if op.name in per_step}


def compile(fetches, steps, *, feeds=None, carry=None, mode="while_loop", xla=False,  # noqa: A001
            name="multistep"):
    """Compiles the single training step that ``fetches`` run into one op for ``steps``.

    Args:
      fetches: what the training loop fetches every step: a train op, ``[loss,
        train_op]``, a dict, any nest of ops and tensors of one graph (several train ops
        fetched together run together in each step, as a GAN's two optimizers do).
      steps: N >= 1, the steps of one run (loop mode: the most of one run).
      feeds: the placeholders that take one value per step (default: every placeholder
        the step reads). A placeholder not listed is shared: fed once per run, as is.
      mode: ``"while_loop"`` (default): one copy of the step as the body of a
        ``tf.while_loop`` run N times: graph size independent of N, and a stateful random
        op is one kernel that draws the single steps' stream. ``"unrolled"``: N copies,
        ``name/step_k/<original name>``, each after the previous; refused for a step
        with stateful random ops (each copy would restart the stream). ``"auto"``:
        ``"while_loop"``.
      xla: run the N steps as one XLA program (``tf.function(jit_compile=True)`` called
        from the graph), loop mode only: bitwise equal to N runs of the step compiled
        alone (``steps=1, xla=True``), not to the plain step (XLA fuses and reorders the
        arithmetic). A step XLA cannot compile (an op without an XLA kernel, a
        ``tf.data`` iterator, ref variables) is refused at build time, naming the op.
      carry: ``{initial: final}``: state a program feeds back from run to run (an RNN's
        final state, fed as the next run's initial state). ``initial`` is a placeholder
        or a tensor of the step (``cell.zero_state``'s), ``final`` a tensor of the step
        of the same shape: step 1 reads ``initial`` (as fed to the run, or as computed),
        step k the ``final`` of step k-1; ``Compiled.carry`` holds the last step's.
      name: the name scope of the copies (and of the loop).

    Returns:
      A ``Compiled``: ``run(sess, feed_dict)`` takes the original placeholders as keys;
      ``run(sess, feeds=[...])`` the single-step feed dicts of the run's steps.

    Raises:
      ValueError, TypeError: before anything is built or run, for a program the compiler
        cannot keep bitwise (each message names the op or argument and the fix).
      RuntimeError: the graph is finalized (compile before creating the session).
    """
    return compile_program(fetches, steps, feeds=feeds, carry=carry, mode=mode, xla=xla,
                           name=name, tripwires=True)


def compile_program(fetches, steps, *, feeds=None, carry=None, mode="while_loop", xla=False,
                    name="multistep", tripwires=True):
    """``compile``; ``tripwires=False`` leaves the original ops as they are, for a caller
    that sees every run of the session itself and warns of an original op's run there
    (the deferred session, which compiles after its session has run the graph: an edge
    added to an op that has run has no effect)."""
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly():
        raise RuntimeError("ms.compile compiles a tf.compat.v1 graph; call it inside "
                           "`with graph.as_default():` (or after disable_eager_execution()).")
    if graph.finalized:
        raise RuntimeError(
            "ms.compile: the graph is finalized (MonitoredTrainingSession, a Supervisor or "
            "graph.finalize() finalizes it when the session is made), so the compiled "
            "program cannot be added to it. Call ms.compile before creating the session, "
            "where the train op is built, and run fused.train_op in it.")
    steps = positive_int("steps", steps)
    if not isinstance(name, str) or not name.strip("/"):
        raise ValueError(f"ms.compile: name must be a non-empty name scope, got {name!r}.")
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {COMPILE_MODES}, got {mode!r}.")
    if not isinstance(xla, bool):
        raise TypeError(f"ms.compile: xla must be True or False, got {xla!r}.")
    flat = tf.nest.flatten(fetches, expand_composites=True)
    if not flat:
        raise ValueError("ms.compile: fetches is empty; give the train op (and the loss).")
    roots = [_graph_element(graph, item, i) for i, item in enumerate(flat)]
    for root in roots:
        if root.graph is not graph:
            raise ValueError(f"ms.compile: fetch {root.name!r} is not in the default graph.")
    if mode == "auto":
        mode = "while_loop"
    reached = graph_lib.ancestors([getattr(r, "op", r) for r in roots])  # the step's ops
    _refuse_accumulated(reached)
    if xla and any(isinstance(item, tf.SparseTensor) for item in tf.nest.flatten(fetches)):
        raise ValueError(
            "ms.compile: xla=True cannot fetch a tf.SparseTensor: its entry count differs "
            "from step to step, and an XLA program's outputs have static shapes. Fetch it "
            "as a dense tensor (tf.sparse.to_dense), or build without xla=True.")
    if xla and mode == "unrolled" and steps > 1:
        raise ValueError(
            "ms.compile: xla=True with mode='unrolled' is refused: in one XLA program XLA "
            "simplifies across the copies' applies (step k+1 reads what step k wrote), so "
            "the steps would not be bitwise those of the step compiled alone (an MLP with "
            "Adam differed). Use mode='while_loop' with xla=True: bitwise, one body.")
    links = _links(graph, carry)
    if links:
        unread = [a.name for a in links if a.op not in reached]
        if unread:
            raise ValueError(
                f"ms.compile: carry's initial {unread[0]!r} is not read by the step (the "
                f"fetches do not depend on it), so carrying a value into it would change "
                f"nothing. Key carry= by the tensor the step reads as its initial state (an "
                f"RNN's initial_state placeholder or cell.zero_state's tensor).")
    with tf.name_scope(name) as scope:
        wires = tripwires_lib.Tripwires(graph, scope.rstrip("/")) if tripwires else None
        started = (_global_step_at_start(graph, reached) if mode == "while_loop" and not xla
                   else None)  # (where StepFailedError counts the steps a run applied)
        before = [op for op in (wires and wires.check, started and started[1]) if op]
        built = build(roots, steps, scope.rstrip("/"), mode, feeds=feeds, xla=xla, links=links,
                      dynamic=frozenset() if xla else _dynamic(fetches, roots),
                      before=tf.group(before) if len(before) > 1 else
                      before[0] if before else None)
    if built.program is not None:
        xla_lib.warn_random_under_xla(built.program, name=built.label)
    if wires is not None:
        wires.guard(built.copied)
    structured = _structured(fetches, built.values)
    loss = _loss(fetches, roots)
    return Compiled(
        train_op=built.train_op, values=structured,
        losses=None if loss is None else built.values[loss],
        summaries=_summaries(fetches, roots, built.values),
        inputs=dict(built.inputs), steps=steps, name=built.label,
        mode=mode + ("+xla" if xla else ""),
        global_step=_global_step(graph, built.copied),
        step_increment=_step_increment(graph, built.copied),
        steps_per_run=built.run_length.read if built.run_length is not None else None,
        carry=list(built.carried) if links else None,
        carry_in=list(links) if links else None,
        _finals={initial: final for initial, (_, final) in links.items()},
        _run_length=built.run_length,
        _by_name={original.name: (original, per_step)
                  for original, per_step in built.inputs.items()},
        _copied=frozenset(op.name for op in built.copied),
        _reads=frozenset(op.name for op in built.placeholders),
        _roots=tuple(roots), _loss_index=loss,
        _dynamic={id(v): roots[j].shape.as_list() for j, v in enumerate(built.values)
                  if isinstance(v, tf.RaggedTensor)},
        _partial={id(built.values[j]): read for j, read in (built.partial or {}).items()},
        _started=started and started[0])


def _global_step_at_start(graph, step_ops):
    """For a step (``step_ops``: its ops) with a check that can fail at any step (an
    ``Assert``, a ``check_numerics``) and a global step: (a variable, the op that sets it to the global
    step as a run starts), so that ``StepFailedError`` can say whether the failing step's
    own updates ran (a check guards only what reads its output, as in a single step);
    else None."""
    step = graph_lib.global_step_variable(graph)
    if step is None or not any(op.type in _CHECKS for op in step_ops):
        return None
    with tf.control_dependencies(None):
        started = tf.compat.v1.Variable(  # (never initialised: each run sets it first)
            tf.zeros([], step.dtype.base_dtype), trainable=False, use_resource=True,
            collections=[], name="global_step_at_start")
        return started, started.assign(tf.identity(step), read_value=False)


# A step that hands its gradients to an accumulator another run takes them from
# (SyncReplicasOptimizer: the chief's queue runner aggregates and puts a token back).
ACCUMULATING = ("AccumulatorApplyGradient", "ResourceAccumulatorApplyGradient",
                "SparseAccumulatorApplyGradient")


def _refuse_accumulated(step):
    """ValueError for a step (``step``: its ops) whose gradients go to a ``ConditionalAccumulator`` that
    another run aggregates (``SyncReplicasOptimizer``): the step waits for a token that
    run puts back, so N steps in one run would wait on themselves (it hung). A step that
    takes the mean from its accumulator itself is a step like any other."""
    taken = {op.inputs[0].op for op in step if op.type.endswith("AccumulatorTakeGradient")}
    found = [op for op in step if op.type in ACCUMULATING and op.inputs[0].op not in taken]
    if found:
        raise ValueError(
            f"ms.compile: the step hands its gradients to a ConditionalAccumulator "
            f"({graph_lib.named_few(repr(op.name) for op in found)}), as "
            f"tf.compat.v1.train.SyncReplicasOptimizer "
            f"does: another run (the chief's queue runner) aggregates them and puts back "
            f"the token the next step waits for, so N steps in one run would wait on "
            f"themselves. Run that step as written, or fuse a synchronous step that "
            f"all-reduces within the run instead: ms.distribute under a "
            f"MultiWorkerMirroredStrategy.")


def _structured(fetches, values):
    """``fetches``' structure over the per-step ``values`` (``build``'s, one a flat
    component). A ``tf.SparseTensor`` fetch becomes one of rank + 1, its first dimension
    the step (``tf.sparse.concat`` of each step's, expanded): its entry count differs
    from step to step, so its indices and values come per step as ragged tensors."""
    items, j = [], 0
    for item in tf.nest.flatten(fetches):
        size = len(tf.nest.flatten(item, expand_composites=True))
        part = values[j:j + size]
        if isinstance(item, tf.SparseTensor):
            indices, entries, shapes = part
            with tf.name_scope("sparse_values"):
                step = tf.expand_dims(indices.value_rowids(), 1)
                rank = item.indices.shape[1]
                items.append(tf.SparseTensor(
                    tf.concat([step, tf.reshape(indices.flat_values, [-1, rank])], 1),
                    entries.flat_values,
                    tf.concat([tf.shape(shapes, out_type=tf.int64)[:1],
                               tf.reduce_max(shapes, axis=0)], 0)))
        else:
            items.append(tf.nest.pack_sequence_as(item, part, expand_composites=True))
        j += size
    return tf.nest.pack_sequence_as(fetches, items)


def _dynamic(fetches, roots):
    """The indices of the fetched tensors whose shape can differ from step to step: some
    dimension unknown (a batch dimension over a ``tf.data`` input whose last batch is
    short, a ``tf.where``'s), the rank known; of composites, a ``tf.SparseTensor``'s
    indices and values (its entry count), no other's components."""
    composite, j = set(), 0
    for item in tf.nest.flatten(fetches):
        size = len(tf.nest.flatten(item, expand_composites=True))
        if isinstance(item, tf.__internal__.CompositeTensor):
            composite.update(range(j + (2 if isinstance(item, tf.SparseTensor) else 0),
                                   j + size))
        j += size
    return frozenset(j for j, r in enumerate(roots) if isinstance(r, tf.Tensor)
                     and j not in composite and r.shape.rank is not None
                     and not r.shape.is_fully_defined())


def _links(graph, carry):
    """``carry`` ({initial: final}) as ``build``'s links: {initial: (initial, final)}."""
    if carry is None:
        return {}
    if not isinstance(carry, dict):
        raise TypeError(f"ms.compile: carry must be a dict {{initial: final}} (an RNN's "
                        f"initial state -> its final state), got {type(carry).__name__}.")
    links = {}
    for initial, final in carry.items():
        if any(isinstance(t, tf.Variable) for t in tf.nest.flatten(initial)):
            raise TypeError(
                f"ms.compile: carry's initial {getattr(initial, 'name', initial)!r} is a "
                f"variable. A variable carries its state from step to step by itself (each "
                f"step reads what the step before wrote); carry= is for a value the loop "
                f"feeds back: key it by the placeholder or tensor the step reads as its "
                f"initial state.")
        pairs = zip(tf.nest.flatten(initial, expand_composites=True),
                    tf.nest.flatten(final, expand_composites=True))
        if len(tf.nest.flatten(initial)) != len(tf.nest.flatten(final)):
            raise ValueError(f"ms.compile: carry pairs {initial!r} with {final!r}, which "
                             f"differ in structure.")
        for a, b in pairs:
            a, b = (_graph_element(graph, t, "carry") for t in (a, b))
            if not isinstance(a, tf.Tensor) or not isinstance(b, tf.Tensor):
                raise TypeError(f"ms.compile: carry takes tensors, got {a!r}: {b!r}.")
            if a.dtype.base_dtype != b.dtype.base_dtype or not a.shape.is_compatible_with(b.shape):
                raise ValueError(
                    f"ms.compile: carry pairs {a.name!r} ({a.dtype.name} {a.shape}) with "
                    f"{b.name!r} ({b.dtype.name} {b.shape}); the final state must have the "
                    f"initial state's dtype and shape.")
            links[a] = (a, b)
    return links


Built = collections.namedtuple("Built", "values train_op run_length inputs carried copied label "
                                        "program partial placeholders")


def _warn_unordered_fetches(at_end, copied, label):
    """Warns of each fetched read of a resource variable that the step writes with no
    order between them (``sess.run([train, global_step])``): a single ``sess.run``
    returns the value before or after the write by TensorFlow's schedule, run by run (seen
    both ways in fresh processes of one script); the compiled steps return it after."""
    written = graph_lib.written_variables(copied)
    racing = [t for t in at_end if t.op.type == "ReadVariableOp"
              and graph_lib.source_op(t.op.inputs[0]) in written]
    if racing:
        names = graph_lib.named_few(repr(written[graph_lib.source_op(t.op.inputs[0])])
                                    for t in racing)
        warnings.warn(
            f"{label}: {names} {'is' if len(racing) == 1 else 'are'} fetched beside the "
            f"step's write of it, with no order "
            f"between them: a single sess.run returns the value before or after the write "
            f"as TensorFlow schedules it, run by run; each compiled step returns it after. "
            f"For one answer, fetch it in a run of its own, or fetch a read built under "
            f"tf.control_dependencies([train_op]).",
            RuntimeWarning, stacklevel=graph_lib.user_stacklevel())


def build(roots, steps, label, mode, *, feeds=None, given=None, links=None, run_length=None,
          done=None, xla=False, strip=None, random="refuse", finish=None, stop=None,
          dynamic=frozenset(), before=None):
    """The compiler proper, in the current name scope ``label``: ``roots`` (ops and
    tensors) run ``steps`` times, ``mode`` ``"unrolled"`` or ``"while_loop"``.

    ``feeds``: as ``compile``'s. ``given``: {placeholder the step reads: the ``[steps,
    ...]`` tensor whose slice k step k reads} (``ms.unroll``'s inputs). ``links``:
    {placeholder: (its value at step 1, the tensor of the step that is its value at the
    next step)} (``carry=``). ``run_length``: loop mode's (made here if None); ``done``:
    a variable the loop sets to the steps ended so far. ``xla``: the steps as one XLA
    program. ``strip``: [(the name prefix of a step's ops, the label its copies go under)]:
    copy k of an op under a prefix is ``<its label>/step_k/<the rest of its name>``
    (loop mode ``.../loop/body/step/<the rest>``), of an op under none
    ``<label>/step_k/_outside/<its name>``; None: ``<label>/step_k/<its name>``.
    ``random``: ``"refuse"`` (``ms.compile``'s: refuse stateful random ops in unrolled
    mode, warn of them in loop mode and under XLA) or ``"warn"`` (``ms.unroll``'s, which
    warns itself).
    ``finish(end, carried, fetched)``: under XLA, the op that ends the run, given the end
    of its last step, each link's value after it and each root's values (all ``steps``
    entries; None for an op); ``stop``: an int link's placeholder, after whose step a loop
    stops once its value is not 0 (a halt). ``dynamic``: the indices of tensor roots whose
    shape can differ from step to step (a short final batch): their values are a
    ``RaggedTensor`` ``[N, (d1), ...]`` (not under XLA, where shapes are static).
    ``before``: an op the first step waits on (``ms.compile``'s tripwire check).

    ``Built.partial``: in loop mode with ``done``, {index of a tensor root of static
    shape: a read of the ``[steps, ...]`` variable each step writes its value into
    before it counts as done}: the values of the steps a failed run applied.

    Returns a ``Built``: ``values`` (per root: the op's train op, or the tensor's ``[N,
    ...]`` values), ``carried`` (each link's value after the last step), ..."""
    given, links = dict(given or {}), dict(links or {})
    if mode == "while_loop" and steps > MOST_LOOP_STEPS:
        raise ValueError(
            f"{label}: steps={steps} is more than a loop can count: its step counter and "
            f"run length are int32, so a run makes at most {MOST_LOOP_STEPS} steps. Ask for "
            f"fewer (a run of a million steps already makes the call's cost nothing).")
    internal = {t.op for t in list(given) + list(links)}
    graph = tf.compat.v1.get_default_graph()
    if not isinstance(graph, tf.__internal__.FuncGraph):
        streams_lib.share(graph)  # (random ops no session holds: one stream each)
    wires = set(graph.get_collection(tripwires_lib.TRIPWIRES))  # (an earlier compile's: not copied)
    ops = [op for op in _ancestors_in_order(
        [r if isinstance(r, tf.Operation) else r.op for r in roots]
        + [following.op for _, following in links.values()]) if op not in wires]
    where = {op: "input" if op in internal else placement(op) for op in ops}
    placeholders = [op for op in ops if where[op] == "input"]
    fed = per_step_placeholders([p for p in placeholders if p not in internal], feeds)
    _refuse_ref_variables([op for op in ops if where[op] == "shared"], mode, xla, label)
    copied = [op for op in ops if where[op] == "copied"]
    _refuse_races(copied, label)
    randoms = graph_lib.stateful_random_ops(copied)  # (the ops whose stream is not shared)
    if mode == "unrolled" and steps > 1 and randoms and random == "refuse":
        raise ValueError(
            f"ms.compile: {streams_lib.unshared(graph, randoms)}: in mode='unrolled' each "
            f"of the {steps} copies would restart its stream, so the steps would draw other "
            f"numbers than single steps do. Use mode='while_loop' (the default).")
    if randoms and random == "refuse" and (xla or mode == "while_loop"):
        warnings.warn(
            f"{label}: {streams_lib.unshared(graph, randoms)}: the compiled steps draw other "
            f"numbers than the program as written wherever another copy of it runs too (an "
            f"evaluation, another program)" + (", and XLA draws with a generator of its "
                                               "own" if xla else "") + ".",
            RuntimeWarning, stacklevel=graph_lib.user_stacklevel())
    convolutions = sorted({op.type for op in copied
                           if op.type.startswith(("Conv", "DepthwiseConv"))})
    if xla and convolutions:
        warnings.warn(
            f"{label}: xla=True over convolutions ({', '.join(convolutions)}): on the CPU XLA "
            f"runs convolutions with kernels of its own, not oneDNN's, which can be many "
            f"times slower. Measure both (multistep bench) before choosing xla=True. "
            f"(Bitwise still means: equal to single steps of the step compiled alone.)",
            RuntimeWarning, stacklevel=graph_lib.user_stacklevel())
    nccl = [f"{op.name!r} ({op.type})" for op in ops if op.type.startswith("Nccl")]
    keyed = [f"{op.name!r} ({op.type})" for op in ops if op.type.startswith("Collective")]
    if mode == "unrolled" and steps > 1 and (nccl or steps > MOST_KEYED_COPIES and keyed):
        raise ValueError(
            f"ms.compile: the step all-reduces across devices ({graph_lib.named_few(nccl or keyed)}); "
            f"{steps} unrolled copies of it need keys of their own, which the compiler gives "
            f"collective ops up to {MOST_KEYED_COPIES} copies and NCCL ops not at all. Use "
            f"mode='while_loop' (one kernel per op, run once a step) or fewer steps.")
    if mode == "unrolled" and steps > 1:
        check_graph_size(graph, set(copied).__contains__, steps, label)
    template = template_of(copied, fed + sorted(internal, key=lambda op: op._id),  # noqa: SLF001
                           strip, label, skip={w.name for w in wires})
    template = template._replace(at_end=state_fetches(roots, copied))
    _warn_unordered_fetches(template.at_end, copied, label)
    _warn_sum_order(copied, {p.name for p in fed}, template,
                    f"{label}/step_1" if mode == "unrolled" else f"{label}/loop/body/step", label)
    if xla:  # conds and loops built in a graph are lowered to Switch/Merge: XLA takes them whole
        for node in template.graph_def.node:
            if node.op in _FUNCTIONAL_CONTROL_FLOW:
                node.attr["_lower_using_switch_merge"].b = False
    with tf.name_scope("inputs"):
        inputs = {p.outputs[0]: per_step_input(p, label) for p in fed}
    if mode == "while_loop" and run_length is None:  # (ms.compile's: count the steps done
        can_fail = any(op.type.startswith(("IteratorGetNext", "QueueDequeue"))  # where a run
                       or not xla and op.type in _CHECKS for op in copied)  # can stop midway)
        run_length = make_run_length(steps, count_done=can_fail)
        done = run_length.done
    partial = {} if mode == "while_loop" and done is not None and not xla else None
    count = steps if mode == "unrolled" else run_length.read
    with tf.compat.v1.name_scope(f"{label}/inputs/"):
        batches = {**prepared(inputs, count, label), **given}
    core = _unrolled if mode == "unrolled" else _while_loop
    program = None
    if not xla:
        values, end, carried = core(template, roots, batches, links, count, steps, label,
                                    done, dynamic=dynamic, partial=partial, stop=stop,
                                    before=before)
    else:
        program = tf.function(lambda: _program_body(core, template, roots, batches,
                                                    links, count, steps, label, done, stop),
                              jit_compile=True, autograph=False)
        with tf.control_dependencies([] if before is None else [before]):
            outputs = program()
    if xla:
        program = program.get_concrete_function().graph
        why = xla_lib.uncompilable(program)
        if why is not None and "'Optional" in why:
            why += (" (the gradient of a tf.cond or tf.while_loop built outside an XLA "
                    "context keeps the branch's intermediates as Optionals)")
        if why is not None:
            raise ValueError(f"{label}: xla=True, but the steps cannot compile: {why}. Build "
                             f"without XLA (mode='while_loop' runs the step as written).")
        end, done = outputs[0].op, outputs[0] if mode == "while_loop" else None
        tensors = iter(outputs[1:])
        fetched = [None if isinstance(r, tf.Operation) else next(tensors) for r in roots]
        carried = list(tensors)
        values = lambda: [None if v is None else _first(v, done, f"values_{j}")  # noqa: E731
                          for j, v in enumerate(fetched)]
    if finish is not None:
        end = finish(end, carried, fetched)
    with tf.control_dependencies([end]):
        train_op = tf.no_op(name="train")
    with tf.control_dependencies([train_op]):
        values = values()
    outputs = [train_op if isinstance(r, tf.Operation) else v for r, v in zip(roots, values)]
    return Built(outputs, train_op, run_length, inputs, carried, copied, label, program,
                 partial, placeholders)


def _program_body(core, template, roots, batches, links, count, steps, label, done, stop):
    """The steps inside an XLA program: [its end (loop mode: the steps it made, int32
    ``[1]``), each tensor root's values (loop mode: all ``steps`` entries, of which
    ``_first`` takes those made), each link's last value]. A link's constant first value
    is built in the program rather than passed to it (a host node and an argument less)."""
    links = {p: (tf.constant(tf.get_static_value(first), first.dtype)
                 if first.op.type == "Const" else first, following)
             for p, (first, following) in links.items()}
    values, end, carried = core(template, roots, batches, links, count, steps, label, done,
                                static=True, stop=stop)
    with tf.control_dependencies([end]):
        made, fetched = values(whole=True)
        return ([tf.constant(True) if made is None else tf.reshape(made, [1])]
                + [v for v in fetched if v is not None] + list(carried))


def _first(values, made, name):
    """The entries of an XLA loop's ``values`` that its steps made (``made``: int32 ``[1]``),
    taken on the host: inside the program a slice of a size known only at run time makes
    an output of dynamic shape, which cost 17 µs a call on blobs (57 against 40 µs for the
    XLA call of a minimal loop that keeps its losses, N = 10). Unrolled (``made`` None):
    ``values``."""
    if made is None:
        return tf.identity(values, name=name)
    rank = values.shape.rank
    size = made if rank == 1 else tf.concat([made, [-1] * (rank - 1)], 0)
    first = tf.slice(values, [0] * rank, size, name=name)
    first.set_shape([None] + values.shape[1:].as_list())  # (a step's shape stays known)
    return first


def _graph_element(graph, item, index):
    if isinstance(item, (tf.Operation, tf.Tensor)):
        return item
    if isinstance(item, str):  # a name, as sess.run takes it
        try:
            return graph.as_graph_element(item)
        except (KeyError, ValueError) as error:
            raise ValueError(f"ms.compile: fetch {index}, {item!r}: {error}") from None
    if isinstance(item, tf.Variable):
        return item.value() if hasattr(item, "handle") else item._ref()  # noqa: SLF001
    raise TypeError(f"ms.compile: fetch {index} is {type(item).__name__} {item!r}, not an op "
                    f"or a tensor.")


def _unrolled(template, roots, batches, links, count, steps, label, done, static=False,
              dynamic=frozenset(), partial=None, stop=None, before=None):
    """N copies, each after the one before (the first after ``before``); returns (a
    builder of the values, the last copy's end, each link's value after the last copy)."""
    del count, done, static, partial, stop  # (every run makes ``steps`` steps)
    prefixes = [f"{label}/step_{k + 1}" for k in range(steps)]
    slices = [step_inputs(batches, k, template, prefixes[k]) for k in range(steps)]
    for k in range(steps):  # a link: step 1 reads its first value, step k the one before's
        for placeholder, (first, following) in links.items():
            slices[k][placeholder] = first if k == 0 else (
                template.rename(following.name, prefixes[k - 1]))
    copies, ends = import_copies(template, [(prefixes[k], slices[k], "previous" if k else before)
                                      for k in range(steps)], roots)
    per_step = [fetched_in(c, roots, lambda root, k=k: slices[k].get(root, root))
                for k, c in enumerate(copies)]
    carried = [fetched_in(copies[-1], [following], lambda root: root)[0]
               for _, following in links.values()]

    def values(whole=False):  # built after the train op: fetching one runs the steps
        if whole:  # (in an XLA program: as _while_loop's)
            return None, values()
        out = []
        for j, root in enumerate(roots):
            if isinstance(root, tf.Operation):
                out.append(None)
            elif j in dynamic:
                out.append(_ragged(
                    tf.concat([tf.reshape(step[j], [-1]) for step in per_step], 0),
                    tf.stack([_shape(step[j]) for step in per_step]),
                    f"values_{j}"))
            else:  # (a shared placeholder or constant fetched: its value at every step)
                out.append(tf.stack([step[j] for step in per_step], name=f"values_{j}"))
        return out

    return values, ends[-1], carried


def _while_loop(template, roots, batches, links, count, steps, label, done, static=False,
                dynamic=frozenset(), partial=None, stop=None, before=None):
    """One copy as the body of a loop run ``count`` (<= ``steps``) times; returns (a
    builder of the values, the loop's end, each link's value after the last step).
    ``static``: the per-step values in arrays of ``steps`` entries, of which the host
    takes the ``count`` made (``_first``: what XLA compiles; past ``CHUNK`` steps, in
    chunks: see ``_chunked``); else arrays of ``count`` entries.
    ``partial``: a dict to fill with ``build``'s ``Built.partial``, or None."""
    tensors = [j for j, root in enumerate(roots) if not isinstance(root, tf.Operation)]
    kept = {} if partial is None else {
        j: tf.compat.v1.Variable(tf.zeros([steps] + roots[j].shape.as_list(),
                                          roots[j].dtype.base_dtype),
                                 trainable=False, use_resource=True, collections=[],
                                 name=f"applied_{j}")
        for j in tensors if j not in dynamic and roots[j].shape.is_fully_defined()}
    placeholders = list(links)

    def going(i, carried):  # whether the loop makes step i + 1
        more = i < count
        return more if stop is None else tf.logical_and(
            more, tf.equal(carried[placeholders.index(stop)], 0))

    def body(i, arrays, carried, offset=None):  # (offset: the index of arrays[0] in the run)
        # v1 control flow: the body is built under the loop's scope; v2: in a function
        # that is inlined as "<name>/loop/body/_<n>/" when the loop is lowered.
        scope = tf.compat.v1.get_default_graph().get_name_scope()
        prefix = f"{scope}/body/step" if scope else "step"
        slices = step_inputs(batches, i, template, prefix)
        slices.update(zip(placeholders, carried))
        [copies], [end] = import_copies(template, [(prefix, slices, i.op)], roots,
                                        gate=not static)
        fetched = fetched_in(copies, roots, lambda root: slices.get(root, tf.identity(root)))
        following = fetched_in(copies, [f for _, f in links.values()], lambda root: root)
        with tf.control_dependencies([end]):
            kept_now = [tf.raw_ops.ResourceStridedSliceAssign(
                ref=kept[j].handle, begin=tf.reshape(i, [1]), end=tf.reshape(i + 1, [1]),
                strides=[1], value=fetched[j], shrink_axis_mask=1) for j in kept]
        with tf.control_dependencies([end] + kept_now):  # (done counts what is kept)
            ended = [] if done is None else [done.assign(i + 1, read_value=False)]
            with tf.control_dependencies(ended):
                at = i if offset is None else i - offset
                written = [_write(array, at, fetched[j]) for j, array in zip(tensors, arrays)]
                return [i + 1, written, [tf.identity(f) for f in following]]

    size = steps if static else count
    arrays = [_array(roots[j], size, j in dynamic) for j in tensors]
    first = [first for first, _ in links.values()]
    start = [] if done is None else [done.assign(0, read_value=False)]
    start += [v.assign(v.initial_value, read_value=False)  # (never initialised: each run
              for v in kept.values()]  # sets it first)
    start += [] if before is None else [before]  # (the steps wait on the loop's counter)
    with tf.control_dependencies(start):
        zero = tf.identity(0) if start else tf.constant(0)
    chunked = static and steps > CHUNK
    if chunked:
        i, arrays, carried = _chunked(body, [roots[j] for j in tensors], going, steps, zero,
                                      first)
    else:
        i, arrays, carried = tf.while_loop(
            lambda i, _, carried: going(i, carried), body, [zero, arrays, first],
            parallel_iterations=1, maximum_iterations=steps, name="loop")
    if partial is not None:
        partial.update((j, variable.value()) for j, variable in kept.items())

    def values(whole=False):  # built after the train op: fetching one runs the steps
        """Each tensor root's values; ``whole`` (in an XLA program): (the steps made, the
        arrays of all ``steps`` entries (or, chunked, of whole chunks))."""
        stacked = {j: _ragged(array[0].concat(), array[1].stack(), f"values_{j}")
                   if isinstance(array, tuple) else
                   _unchunked(array.stack(), roots[j]) if chunked else
                   array.stack() if whole else tf.identity(array.stack(), name=f"values_{j}")
                   for j, array in zip(tensors, arrays)}
        fetched = [stacked.get(j) for j in range(len(roots))]
        return (i, fetched) if whole else fetched

    return values, i.op, carried


# Steps a chunk of an XLA loop keeps: 128 float32 values are 512 bytes, the most a buffer
# may hold for XLA:CPU to run a loop body's thunks in order, inline, rather than through
# its concurrent executor (which cost 1.5 µs a step on blobs when an f32[N] loss buffer,
# N > 128, was written every step).
CHUNK = 128


def _chunked(body, fetched, going, steps, zero, first):
    """An XLA loop that makes steps while ``going(i, carried)``, whose per-step values
    are written into arrays of ``CHUNK`` steps (each a buffer small enough for XLA:CPU's
    sequential executor), each chunk's copied into the ``[steps / CHUNK, CHUNK, ...]``
    arrays once, after its steps:
    an outer loop over chunks, an inner loop over a chunk's steps (``body``, as
    ``_while_loop``'s, writing at the step's index within its chunk). Returns (the steps
    done, the arrays of chunks, each link's value after the last step)."""
    chunks = -(-steps // CHUNK)

    def chunk(c, i, arrays, carried):
        small = [tf.TensorArray(t.dtype.base_dtype, size=CHUNK, element_shape=t.shape)
                 for t in fetched]
        i, small, carried = tf.while_loop(
            lambda i, _, carried: tf.logical_and(going(i, carried), i < (c + 1) * CHUNK),
            lambda i, small, carried: body(i, small, carried, offset=c * CHUNK),
            [i, small, carried], parallel_iterations=1, maximum_iterations=CHUNK,
            name="chunk")
        return [c + 1, i, [a.write(c, s.stack()) for a, s in zip(arrays, small)], carried]

    arrays = [tf.TensorArray(t.dtype.base_dtype, size=chunks,
                             element_shape=tf.TensorShape([CHUNK]).concatenate(t.shape))
              for t in fetched]
    _, i, arrays, carried = tf.while_loop(
        lambda c, i, _, carried: going(i, carried), chunk, [tf.constant(0), zero, arrays, first],
        parallel_iterations=1, maximum_iterations=chunks, name="loop")
    return i, arrays, carried


def _unchunked(stacked, root):
    """``[chunks, CHUNK, ...]`` values as ``[chunks * CHUNK, ...]``."""
    return tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]], 0)) if root.shape.rank \
        else tf.reshape(stacked, [-1])


def step_inputs(batches, index, template, prefix):
    """{placeholder: its value at step ``index`` (a slice of its ``[N, ...]`` batch)} for
    the copy named ``prefix``, each slice named as its placeholder within the copy
    (``<prefix>/<placeholder's name>/_step_input``). Grappler orders the inputs of a sum
    of many (``AddN``) by name, and so its rounding: named so, a copy's inputs sort among
    the copy's ops as the placeholders sort among the step's, and the copy sums in the
    single step's order (``ms.verify`` found ``tf.add_n([x, tanh(x @ a), ...])`` 2e-7
    apart when the slices were named ``inputs/GatherV2``)."""
    out = {}
    for original, batch in batches.items():
        with tf.compat.v1.name_scope(template.rename(original.op.name, prefix) + "/"):
            out[original] = tf.gather(batch, index, name=kernels_lib.STEP_INPUT)
    return out


def _warn_sum_order(copied, fed, template, prefix, label):
    """Warns of a sum of three or more (``AddN``) of the step's values and a tensor from
    outside the step whose copy sorts its inputs otherwise: TensorFlow's default session
    config orders a sum's inputs by name before it runs (Grappler's common-subgraph
    elimination), and a copy's names (``prefix``) sort otherwise against a shared name
    than the step's did, so the copy would round otherwise (``step_inputs`` keeps the
    step's own values and its per-step inputs in order)."""
    copies = {op.name for op in copied}

    def in_copy(reference):
        name = reference.split(":")[0]
        if name in copies:
            return template.rename(reference, prefix)
        if name in fed:
            return f"{template.rename(name, prefix)}/{kernels_lib.STEP_INPUT}"
        return reference

    for op in copied:
        inputs = [i for i in op.node_def.input if not i.startswith("^")]
        if op.type != "AddN" or len(inputs) < 3:
            continue
        outside = [i for i in inputs if i.split(":")[0] not in copies | fed]
        order = sorted(range(len(inputs)), key=inputs.__getitem__)
        if outside and order != sorted(range(len(inputs)), key=lambda j: in_copy(inputs[j])):
            warnings.warn(
                f"{label}: the sum {op.name!r} (AddN) adds values of the step and "
                f"{', '.join(map(repr, outside[:3]))} from outside it. Under TensorFlow's "
                f"default session config Grappler orders a sum's inputs by name, and the "
                f"copies' names sort otherwise against {outside[0]!r} than the step's do, so "
                f"the steps' sums round otherwise than single steps' (by an ulp or so). Run "
                f"the session with config=ms.session_config() (that reordering off: the same "
                f"bits), or add the outside value outside the sum.",
                RuntimeWarning, stacklevel=graph_lib.user_stacklevel())
            return


def _array(root, size, dynamic):
    """Where loop mode keeps a fetch's per-step values: a TensorArray of ``size``; for a
    fetch whose shape can vary from step to step, (its values flattened, their shapes)."""
    dtype = root.dtype.base_dtype
    if not dynamic:
        return tf.TensorArray(dtype, size=size, element_shape=root.shape)
    return (tf.TensorArray(dtype, size=size, infer_shape=False, element_shape=[None]),
            tf.TensorArray(tf.int64, size=size, element_shape=[root.shape.rank]))


def _write(array, index, value):
    if isinstance(array, tuple):
        return (array[0].write(index, tf.reshape(value, [-1])),
                array[1].write(index, _shape(value)))
    if value.op.type == "Shape":  # a SparseTensor's dense_shape: as _shape says, through
        # an op whose output type inference takes as a tensor (an Identity keeps the type)
        value = value + tf.zeros_like(value)
    return array.write(index, value)


def _shape(value):
    # int64 through a Cast: a Shape op's output written to a loop's TensorArray fails
    # TensorFlow's type inference (a logged error, harmless, that reads as a broken graph).
    return tf.cast(tf.shape(value), tf.int64)


def _ragged(flat, shapes, name):
    """The steps' values of a fetch whose shape varies, ``[N, (d1), ..., (dr)]``, from
    their elements in order (``flat``) and each step's shape (``shapes``, ``[N, r]``):
    level l of step k has d1 * ... * dl rows, each of its length d(l+1)."""
    with tf.name_scope(name):
        lengths, rows = [], tf.ones_like(shapes[:, 0])
        for d in range(shapes.shape[1]):
            lengths.append(tf.repeat(shapes[:, d], rows))
            rows = rows * shapes[:, d]
        return tf.RaggedTensor.from_nested_row_lengths(flat, lengths, validate=False)


def _indices(fetches):
    """``fetches``' structure, each tensor or op its index among the flat components (a
    composite, the list of its components' indices)."""
    items, j = [], 0
    for item in tf.nest.flatten(fetches):
        size = len(tf.nest.flatten(item, expand_composites=True))
        items.append(list(range(j, j + size)) if isinstance(
            item, tf.__internal__.CompositeTensor) else j)
        j += size
    return tf.nest.pack_sequence_as(fetches, items)


def _loss(fetches, roots):
    """The index in ``roots`` of the fetch that is the loss: the one keyed "loss" in a
    dict, else the only float scalar tensor fetched that is differentiable in a variable
    (an accuracy fetched beside the loss reaches the weights only through ``argmax`` and
    ``equal``, which have no gradient); or None."""
    index = _indices(fetches)
    if isinstance(fetches, dict) and "loss" in fetches:
        if not isinstance(index["loss"], int):
            return None
        loss = roots[index["loss"]]
        if isinstance(loss, tf.Tensor) and loss.shape.rank not in (0, None):
            raise ValueError(
                f"ms.compile: the fetch keyed 'loss', {loss.name!r}, has shape {loss.shape}; "
                f"the loss is a scalar a step (Compiled.losses, what ms.verify and the "
                f"hooks read). Fetch the scalar loss under 'loss' (tf.reduce_mean), or key "
                f"this tensor otherwise.")
        return index["loss"]
    scalars = [j for j, r in enumerate(roots) if isinstance(r, tf.Tensor)
               and r.dtype.is_floating and r.shape.rank == 0 and _differentiable(r)]
    return scalars[0] if len(scalars) == 1 else None


def _differentiable(tensor):
    """Whether ``tensor`` reaches a variable through ops that have a gradient."""
    from tensorflow.python.framework import ops as ops_lib
    stack, seen = [tensor.op], set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in ("VarHandleOp", "VariableV2", "Variable"):
            return True
        try:
            gradient = ops_lib._gradient_registry.lookup(op.type)  # noqa: SLF001
            if gradient is None:  # (registered NotDifferentiable)
                continue
        except LookupError:  # no gradient registered
            if op.type not in ("ReadVariableOp", "Identity"):
                continue
        stack.extend(t.op for t in op.inputs)
    return False


def _summaries(fetches, roots, values):
    """The values of the fetch that is the step's merged summary: the one keyed "summary"
    in a dict, else the only string scalar that a summary op makes; or None."""
    if isinstance(fetches, dict) and "summary" in fetches:
        index = _indices(fetches)["summary"]
        return values[index] if isinstance(index, int) else None
    found = [v for v, f in zip(values, roots)
             if isinstance(f, tf.Tensor) and f.dtype == tf.string and f.op.type.endswith("Summary")]
    return found[0] if len(found) == 1 else None


def _refuse_races(copied, label):
    """Refuse a step whose state depends on which of two unordered ops runs first."""
    races = graph_lib.unordered_state_reads(copied)
    if not races:
        return
    read, write, variable, goes_to = races[0]
    more = f" ({len(races) - 1} more such reads)" if len(races) > 1 else ""
    raise ValueError(
        f"{label}: the step reads {variable.name!r} in {read.name!r} ({read.type})"
        f"{graph_lib.built_at(read)} with no order against the step's write of it in "
        f"{write.name!r} ({write.type}){graph_lib.built_at(write)}, and the value read goes "
        f"on to the step's state (through {goes_to.name!r}, {goes_to.type}){more}. "
        f"TensorFlow runs two unordered ops in whichever order they are ready in, run by "
        f"run, so single steps of this program do not leave the same state twice (an EMA "
        f"grouped beside the apply instead of after it, as the pre-2017 CIFAR-10 tutorial "
        f"built it), and no compiled program can promise to equal them. Order the read: "
        f"build it under tf.control_dependencies([train_op]) (an EMA after the apply, as "
        f"the tutorial does now), or build the apply under "
        f"tf.control_dependencies([the read]).")


def _refuse_ref_variables(shared, mode, xla, label):
    """Refuse ref variables where the steps cannot carry them: in an XLA program, and in
    a v2 ``tf.while_loop`` body (a function, which cannot capture a ref)."""
    refs = sorted(op.name for op in shared if op.type in ("VariableV2", "Variable"))
    loop_v2 = mode == "while_loop" and tf.compat.v1.control_flow_v2_enabled()
    if not refs or not (xla or loop_v2):
        return
    where = ("xla=True: XLA compiles resource variables only" if xla else
             "mode='while_loop' under v2 control flow: the loop body is a function, which "
             "cannot capture a ref variable")
    fix = ("build without XLA" if xla else
           "mode='unrolled', or disable_v2_behavior() (v1 control flow carries refs)")
    raise ValueError(
        f"{label}: the step uses ref variable(s) {graph_lib.named_few(map(repr, refs))}"
        f"{', ...' if len(refs) > 3 else ''} (use_resource=False, what "
        f"disable_v2_behavior() and disable_resource_variables() make), and {where}. Fix: "
        f"resource variables (tf.compat.v1.enable_resource_variables() before the model is "
        f"built, or use_resource=True), or {fix}.")


def check_graph_size(graph, in_step, steps, label):
    """Refuse ``steps`` copies of the step (the graph's ops for which ``in_step(op)``)
    that would make a GraphDef over protobuf's limit."""
    now = step_bytes = 0
    for op in graph.get_operations():
        size = op.node_def.ByteSize()
        now += size
        step_bytes += size if in_step(op) else 0
    estimate = now + steps * step_bytes
    if estimate > GRAPHDEF_LIMIT:
        raise GraphTooLargeError(
            f"{label}: {steps} unrolled steps of about {step_bytes / 2**20:.1f} MiB each "
            f"would make a GraphDef of about {estimate / 2**30:.1f} GiB, over protobuf's "
            f"2 GiB limit. Use mode='while_loop' (one step body whatever N), a smaller "
            f"N, or feed large constants through placeholders instead of embedding them.")


def _global_step(graph, copied):
    step = graph_lib.global_step_variable(graph)
    if step is None:
        return None
    owner = graph_lib.source_op(step.handle if hasattr(step, "handle") else step._ref())  # noqa: SLF001
    written = graph_lib.written_variables(copied)
    return step if owner in written else None


def _step_increment(graph, copied):
    """What a step adds to the global step: the sum of the constants its ``assign_add``s
    add (``minimize(global_step=)`` adds 1), or None where a write is of another kind."""
    step = graph_lib.global_step_variable(graph)
    if step is None:
        return None
    owner = graph_lib.source_op(step.handle if hasattr(step, "handle") else step._ref())  # noqa: SLF001
    total = 0
    for op in copied:
        if not graph_lib.is_write(op) or graph_lib.source_op(op.inputs[0]) is not owner:
            continue
        value = tf.get_static_value(op.inputs[1]) if op.type in (
            "AssignAddVariableOp", "AssignAdd") else None
        if value is None:
            return None
        total += int(value)
    return total
