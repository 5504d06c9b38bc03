"""Fused vs single steps: the equivalence check that ships with the library.

``verify(build_fn, steps)`` builds the model twice in fresh graphs, once with
``steps`` inner steps and once with 1, gives both the same initial values
(copied by variable name), then after each fused run compares every global
variable (weights, optimizer slots, global step) and every inner step's loss
with those of ``steps`` single-step runs.
"""

import contextlib
import numbers
import re
import warnings

import numpy as np
import tensorflow as tf

from multistep import graph as graph_lib
from multistep._compare import Report, max_abs_diff, same_bits
from multistep.builder.unroll import forced_xla
from multistep.builder.unroll import positive_int as _positive_int
from multistep.compiler import feeds as feed_lib
from multistep.compiler.every import EVERY
from multistep.compiler import kernels as kernels_lib
from multistep.compiler import tripwires

__all__ = ["Report", "session_config", "verify"]


def session_config(base=None):
    """A session configuration under which fused and single steps are bitwise in every
    model tested: ``base`` (or a new ``ConfigProto``) with Grappler's common-subgraph
    elimination off.

    That pass sorts the inputs of every ``AddN`` by name before the sum runs. A weight
    read k >= 3 times has a gradient that is a sum of k terms, and the fused graph's
    steps name theirs differently from a single step's, so the sum can round
    differently. ``ms.unroll`` builds its steps so that the names sort alike; the one
    case measured where they still do not is loop mode with Adam on a weight shared by
    three towers (optimizer slots 1e-8 apart): see the docs' "Models" guide (docs/guides/models.md).

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> config = ms.session_config()
      >>> config.graph_options.rewrite_options.common_subgraph_elimination
      2
    """
    from tensorflow.core.protobuf import rewriter_config_pb2

    config = tf.compat.v1.ConfigProto()
    if base is not None:
        config.CopyFrom(base)
    config.graph_options.rewrite_options.common_subgraph_elimination = (
        rewriter_config_pb2.RewriterConfig.OFF)
    return config


def verify(build_fn, steps, *, runs=4, atol=0.0, config=None, progress=None, explain=False,
           xla=False):
    """Checks that ``steps``-step runs equal single steps, from identical initial values.

    Args:
      build_fn: ``build_fn(steps) -> (unrolled, feed)``. Builds the model in the
        current default graph; ``unrolled`` has ``train_op`` and ``losses``
        (as ``ms.unroll`` returns); ``feed`` is a feed dict, or a callable
        ``feed(run) -> dict`` for run 0, 1, ... of that graph, where fused run
        ``r`` covers global steps ``r*steps ... r*steps + steps - 1``. Initialisers
        that need a placeholder (a ``tf.data`` iterator over
        ``Dataset.from_tensor_slices(placeholder)``) run with ``feed`` (``feed(0)``).
        Seed any ``tf.data`` shuffle or random op: unseeded, the two builds read their
        data in different orders (the report says so).
        Where ``unrolled`` is an ``ms.compile`` program, the reference is the program as
        written: ``build_fn(steps)`` again, in a graph and session of their own, its
        original fetches run by plain ``sess.run`` one step at a time (step j of run r
        fed slice j of ``feed(r)``, a ``carry=`` state fed back step by step), never a
        1-step compile of itself. For an ``ms.compile`` program ``feed`` (or
        ``feed(run)``) may also be the run's feed dicts, one a step, as
        ``fused.run(sess, feeds=[...])`` takes them: the form a placeholder of no shape
        needs; step j of the reference is then fed the j-th.
      steps: inner steps per fused run (>= 1).
      runs: fused runs to compare (>= 1).
      atol: allowed max |Δ|; 0.0 asks for exact equality.
      config: the ``tf.compat.v1.ConfigProto`` of both sessions; default: TensorFlow's
        default (what your training runs with). ``ms.session_config()`` turns off the
        Grappler pass that can reorder sums.
      progress: optional callable ``(runs done, runs)``, called after each run.
      explain: the summary also says whether each inner step executed the same kernels
        as a single step (always said when the values diverge or the kernels differ).
        The kernels are read from the partition graphs of the first run (after Grappler
        and oneDNN's rewrites): equal bits on one CPU prove less than equal kernels,
        which round alike on any.
      xla: build every ``ms.unroll`` in ``build_fn`` with ``xla=True`` (whatever it
        passes), and compare the fused XLA program with ``steps`` runs of the
        single-step XLA program: the same promise, bitwise, for the compiled mode.
        Plain single steps (no XLA) run beside them, and ``plain_max_abs_diff`` reports
        the distance to them as information: XLA's fusions round otherwise than
        TensorFlow's kernels, the same way in the fused and the single-step program.

    Returns:
      A ``Report``; ``report.ok`` is True when nothing differed by more than ``atol``.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> def build(steps):
      ...     w = tf.compat.v1.get_variable("w", initializer=2.0)
      ...     opt = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
      ...     return ms.unroll(lambda: w * w, opt, steps), {}
      >>> ms.verify(build, steps=3, runs=2).ok
      True
    """
    if not callable(build_fn):
        raise TypeError(f"verify: build_fn must be a callable build_fn(steps) -> (unrolled, "
                        f"feed), got {type(build_fn).__name__}.")
    steps = _positive_int("steps", steps)
    runs = _positive_int("runs", runs)
    if not isinstance(atol, numbers.Real) or not atol >= 0:
        raise ValueError(f"atol must be a number >= 0, got {atol!r}.")
    for option, value in (("xla", xla), ("explain", explain)):
        if not isinstance(value, bool):
            raise TypeError(f"verify: {option} must be True or False, got {value!r}.")
    with warnings.catch_warnings():  # the reference runs a compiled step's original ops
        warnings.simplefilter("ignore", tripwires.OriginalOpRanWarning)
        return _verify(build_fn, steps, runs, atol, config, progress, explain, xla)


def _verify(build_fn, steps, runs, atol, config, progress, explain, xla):
    compiled = forced_xla(True) if xla else contextlib.nullcontext()
    with compiled:
        fused = _Program(build_fn, steps, config)
        # mode="auto" chooses by timing, in each build: the single step is built as the
        # fused program's steps were, under XLA or not, whatever a 1-step build would pick.
        alike = (forced_xla(fused.mode.endswith("+xla")) if not xla and fused.mode
                 else contextlib.nullcontext())
        # ms.compile's program is checked against the program as written: its original
        # fetches, run by plain sess.run one step at a time, in a graph of their own.
        with alike:
            single = _Program(build_fn, steps if fused.compiled else 1, config,
                              as_written=fused.compiled)
    plain = None
    if xla:
        with forced_xla(False):
            plain = _Program(build_fn, 1, config)
    try:
        names = _matching_names(fused, single)
        fused.load(single.values())
        plain_diff = None
        if plain is not None:
            _matching_names(fused, plain)
            plain.load(single.values())
            plain_diff = 0.0
        per_variable = dict.fromkeys(names + ["losses"], 0.0)
        first, bitwise = None, True
        fused_losses, single_losses = [], []
        for run in range(runs):
            try:
                got = fused.run(run)
                want = (single.run_as_written(run) if single.as_written else
                        np.concatenate([single.run(run * steps + j) for j in range(steps)]))
            except tf.errors.OutOfRangeError as error:
                raise ValueError(
                    f"verify: the input ran out in run {run + 1} of {runs}: each build makes "
                    f"steps x runs = {steps * runs} steps, one batch each, and its input had "
                    f"fewer. Give it that many batches (e.g. dataset.repeat()) or ask for fewer "
                    f"runs.") from error
            if run == 0:
                difference, same_kernels = _compare_kernels(fused, single)
            if plain is not None:
                plain_losses = np.concatenate([plain.run(run * steps + j) for j in range(steps)])
                plain_values, now = plain.values(), fused.values()
                plain_diff = max([plain_diff, max_abs_diff(got, plain_losses)]
                                 + [max_abs_diff(now[n], plain_values[n]) for n in names])
            fused_losses.append(got)
            single_losses.append(want)
            fused_values, single_values = fused.values(), single.values()
            pairs = [(n, fused_values[n], single_values[n]) for n in names]
            pairs.append(("losses", got, want))
            for name, a, b in pairs:
                diff = max_abs_diff(a, b)
                bitwise = bitwise and same_bits(a, b)
                per_variable[name] = max(per_variable[name], diff)
                if first is None and not diff <= atol:
                    first = (run + 1, name)
            if progress is not None:
                progress(run + 1, runs)
        return Report(steps=steps, runs=runs, atol=float(atol), per_variable=per_variable,
                      first_divergence=first, bitwise=bitwise,
                      fused_losses=np.concatenate(fused_losses),
                      single_losses=np.concatenate(single_losses),
                      final_values=fused_values, kernels=difference,
                      same_kernels=same_kernels, explain=bool(explain), xla=bool(xla),
                      plain_max_abs_diff=plain_diff, data_order=_data_order(fused, single),
                      random_ops=_random_ops(fused), as_written=single.as_written,
                      every=_every(single))
    finally:
        for program in (fused, single, plain):
            if program is not None:
                program.close()


def _compare_kernels(fused, single):
    """(the first kernel difference or None, same kernels: True, False or None where
    a side's step kernels could not be read) from the programs' first runs."""
    # ms.unroll's steps are "<name>/step_k/<scope>/...", ms.compile's "<name>/step_k/<op>".
    read = kernels_lib.of_copies if fused.compiled else kernels_lib.of_steps
    steps = read(fused.nodes, fused.label)
    if single.as_written:  # the original step's own kernels, by their names
        one = kernels_lib.by_name(single.nodes)
    else:
        singles = read(single.nodes, single.label)
        one = singles.get(1, singles.get(kernels_lib.LOOP))  # (a compiled loop's one step)
    if not steps or one is None:
        return None, None
    difference = kernels_lib.compare(steps, one)
    return difference, difference is None


class _Program:
    """One build of the model in its own graph and session."""

    def __init__(self, build_fn, steps, config=None, as_written=False):
        self.steps = steps
        self.as_written = as_written  # run the compiled program's original fetches
        self.nodes = None  # the executed kernels of the first run (partition graphs)
        self.graph = tf.Graph()
        with self.graph.as_default():
            built = build_fn(steps)
            if not (isinstance(built, tuple) and len(built) == 2):
                raise TypeError(
                    f"build_fn({steps}) must return (unrolled, feed_dict), got "
                    f"{type(built).__name__}.")
            unrolled, self.feed = built
            if not (hasattr(unrolled, "train_op") and hasattr(unrolled, "losses")):
                raise TypeError(f"build_fn({steps}) returned {type(unrolled).__name__} "
                                "as unrolled; it needs .train_op and .losses (see ms.unroll).")
            if unrolled.losses is None:
                raise TypeError(
                    f"build_fn({steps}) returned a program without losses: verify compares "
                    f"each step's loss. Compile the loss with the train op, e.g. "
                    f"ms.compile({{'loss': loss, 'train': train_op}}, steps).")
            if not (self.feed is None or isinstance(self.feed, (dict, list))
                    or callable(self.feed)):
                raise TypeError(f"build_fn({steps}) returned a feed of type "
                                f"{type(self.feed).__name__}; expected a dict, a list of "
                                f"feed dicts (one a step, as fused.run(feeds=...)) or a "
                                f"callable run -> either.")
            n = unrolled.losses.shape[0] if unrolled.losses.shape.rank == 1 else None
            if n is not None and n != steps:
                raise ValueError(f"build_fn({steps}) built {n} inner steps, expected {steps}.")
            self.fetch = (unrolled.train_op, unrolled.losses)
            if as_written:  # the original fetches, one step a sess.run
                self.compiled_program = unrolled
                roots = list(unrolled._roots)  # noqa: SLF001
                self.fetch = (roots, roots[unrolled._loss_index],  # noqa: SLF001
                              list(unrolled._finals.values()))  # noqa: SLF001
            # carry= (an RNN's state): each run starts from what the run before carried
            # out, as the program's own loop feeds it; the first from the build's feed.
            self._carry_in = [] if as_written else tf.nest.flatten(
                getattr(unrolled, "carry_in", None) or [])
            self._carried = None
            if self._carry_in:
                self.fetch += (tf.nest.flatten(unrolled.carry),)
            # ms.compile's program takes the original placeholders, [steps, ...] values.
            self.compiled = hasattr(unrolled, "feed_dict")
            self._translate = _translator(unrolled, steps, self.compiled)
            self.label = getattr(unrolled, "name", "multistep")
            self.mode = getattr(unrolled, "mode", None) or ""  # what was built ("+xla")
            self.variables = {_name(v): v for v in tf.compat.v1.global_variables()}
            self._placeholders, assigns = {}, []
            for name, v in self.variables.items():
                ph = tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape)
                self._placeholders[name] = ph
                assigns.append(v.assign(ph))
            self._load = tf.group(*assigns)
            # Reads made now: the graph is finalized below, and fetching a distributed
            # (MirroredStrategy) variable itself would make a read op at run time.
            self._reads = {name: tf.identity(v) for name, v in self.variables.items()}
            self._init = [tf.compat.v1.global_variables_initializer(), _local_init_op()]
            queues = self.graph.get_collection(tf.compat.v1.GraphKeys.QUEUE_RUNNERS)
            _refuse_unfilled_queues(self.fetch, queues, steps)
            self.graph.finalize()
        if queues:  # a queue-fed input: a dequeue that waits forever would hang verify
            config = tf.compat.v1.ConfigProto() if config is None else _copy(config)
            config.operation_timeout_in_ms = config.operation_timeout_in_ms or _QUEUE_TIMEOUT_MS
        self.session = tf.compat.v1.Session(graph=self.graph, config=config)
        feed = self._init_feed()
        for op in self._init:  # variables first: local init ops may read them
            self.session.run(op, feed)
        self._coordinator, self._threads = None, []
        if queues:
            self._coordinator = tf.compat.v1.train.Coordinator()
            with self.graph.as_default():  # (refused where eager execution is on)
                self._threads = tf.compat.v1.train.start_queue_runners(
                    self.session, coord=self._coordinator)

    def _init_feed(self):
        """The feed the initialisers run with: none where they need no placeholder, else
        the build's feed (run 0's, where it is a callable). A ``tf.data`` iterator made from
        a placeholder (``Dataset.from_tensor_slices(ph)``) is initialised with the value
        that feed gives it, as the user's own ``sess.run(iterator.initializer, feed)``."""
        if not _unfed_placeholders(self._init, {}):
            return None
        feed = (self.feed(0) if callable(self.feed) else self.feed) or {}
        feed = feed[0] if isinstance(feed, list) else feed  # (feeds=: the first step's)
        missing = _unfed_placeholders(self._init, feed)
        if missing:
            raise ValueError(
                f"build_fn({self.steps})'s graph cannot be initialised: its initialisers "
                f"(of the variables, tables and tf.data iterators) need placeholder(s) "
                f"{missing} fed, and the feed build_fn returned does not give them. Return "
                f"their values in it, e.g. (unrolled, {{data_placeholder: data}}): verify "
                f"runs the initialisers with that feed (with feed(0), where it is a callable).")
        return feed

    def run(self, index):
        feed = self._translate(self.feed(index) if callable(self.feed) else self.feed)
        if self._carried is not None:
            feed = {**(feed or {}), **dict(zip(self._carry_in, self._carried))}
        if self.nodes is None:
            values, self.nodes = kernels_lib.executed(self.session, self.fetch, feed)
        else:
            values = self.session.run(self.fetch, feed)
        if self._carry_in:
            self._carried = values[2]
        return np.asarray(values[1], np.float32).reshape(-1)

    def run_as_written(self, index):
        """Fused run ``index``'s steps, each a plain ``sess.run`` of the original fetches
        with its own slice of the run's feed; a carried state fed back step by step, as
        the program's own loop feeds it. Returns the steps' losses."""
        program = self.compiled_program
        feed = self.feed(index) if callable(self.feed) else self.feed
        initials = list(program._finals)  # noqa: SLF001
        losses = []
        for j in range(self.steps):
            step = (dict(feed[j]) if isinstance(feed, list)  # (feeds=: the step's own)
                    else feed_lib.step_feed(program, feed, j))
            if self._carried is not None:  # the state the step before ended with
                step.update(zip(initials, self._carried))
            if self.nodes is None:
                values, self.nodes = kernels_lib.executed(self.session, self.fetch, step)
            else:
                values = self.session.run(self.fetch, step)
            if initials:
                self._carried = values[2]
            losses.append(values[1])
        return np.asarray(losses, np.float32).reshape(-1)

    def values(self):
        return self.session.run(self._reads)

    def data_seeds(self):
        """(what, (seed, seed2)) of each random draw of the input pipeline, in the order
        built: the graph's ops that take seed and seed2 tensors (``Dataset.shuffle``,
        ``Dataset.random``), and the random ops of the functions its datasets call (a
        ``map``'s augmentation). (0, 0) asks TensorFlow for a fresh seed each time."""
        ops = [op for op in self.graph.get_operations() if _seed_inputs(op)]
        seeds = self.session.run([_seed_inputs(op) for op in ops])
        found = [(f"{op.type} {op.name!r}", tuple(int(s) for s in pair))
                 for op, pair in zip(ops, seeds)]
        for function in _pipeline_functions(self.graph):
            # The function's name without TensorFlow's prefix and per-process counter.
            called = re.sub(r"^__inference_|_\d+$", "", function.signature.name)
            found += [(f"{node.op} in {called}", (node.attr["seed"].i, node.attr["seed2"].i))
                      for node in function.node_def
                      if "seed" in node.attr and "seed2" in node.attr]
        return found

    def load(self, values):
        self.session.run(self._load, {self._placeholders[n]: values[n] for n in self._placeholders})

    def rename(self, old, new):
        """Report variable ``old`` under the name ``new``."""
        self.variables[new] = self.variables.pop(old)
        self._placeholders[new] = self._placeholders.pop(old)
        self._reads[new] = self._reads.pop(old)

    def close(self):
        if self._coordinator is not None:
            self._coordinator.request_stop()
            self._coordinator.join(self._threads, stop_grace_period_secs=10)
        self.session.close()


def _translator(program, steps, compiled):
    """The feed of one run, from what ``build_fn``'s feed gives: a feed dict, or, for an
    ``ms.compile`` program, a list of feed dicts, one a step (``fused.run``'s
    ``feeds=``; a placeholder of no shape can be fed no other way)."""
    def translate(feed):
        if isinstance(feed, list):
            if not compiled:
                raise TypeError(f"build_fn({steps}) gave a list of feed dicts, which is "
                                f"ms.compile's feeds= form; an ms.unroll program takes one "
                                f"feed dict a run.")
            return program.feed_dict(feeds=feed)
        return program.feed_dict(feed) if compiled else feed
    return translate


_QUEUE_TIMEOUT_MS = 300_000  # a queue-fed program's ops fail after 5 minutes' wait


def _refuse_unfilled_queues(fetch, runners, steps):
    """ValueError for a step that dequeues from a queue nothing in verify's session
    fills: no queue runner of the graph's and no enqueue of the step's own (the program
    fills it with ``enqueue_many`` from its own loop): in verify's new session it is
    empty, and the first dequeue would wait for ever."""
    ops = graph_lib.ancestors([t if isinstance(t, tf.Operation) else t.op
                               for t in tf.nest.flatten(fetch)])
    filled = {runner.queue.queue_ref.op for runner in runners}
    filled |= {op.inputs[0].op for op in ops if op.type.startswith("QueueEnqueue")}
    empty = sorted({op.inputs[0].op.name for op in ops if op.type.startswith("QueueDequeue")
                    and op.inputs[0].op not in filled})
    if empty:
        raise ValueError(
            f"build_fn({steps})'s step dequeues from {graph_lib.named_few(map(repr, empty))}, "
            f"which no queue runner fills: the program fills it from its own loop "
            f"(enqueue_many), and in the session verify makes it is empty, so the first "
            f"step would wait for ever. Give verify a build_fn whose step reads its "
            f"batches from placeholders (the feed it returns) or a tf.data pipeline, or "
            f"fill the queue with a QueueRunner (tf.compat.v1.train.add_queue_runner), "
            f"which verify starts.")


def _copy(config):
    copied = tf.compat.v1.ConfigProto()
    copied.CopyFrom(config)
    return copied


def _local_init_op():
    """What a ``MonitoredTrainingSession``'s scaffold runs after the variables'
    initialiser: the ``LOCAL_INIT_OP`` collection if the model filled it, else the
    local variables' and the tables' initialisers; and the initialiser of every
    initialisable ``tf.data`` iterator in the graph (its ``MakeIterator`` op)."""
    graph = tf.compat.v1.get_default_graph()
    ops = graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_INIT_OP) or [
        tf.compat.v1.local_variables_initializer(), tf.compat.v1.tables_initializer()]
    iterators = [op for op in graph.get_operations() if op.type == "MakeIterator"]
    return tf.group(*ops, *iterators, name="multistep_verify_local_init")


def _unfed_placeholders(ops, feed):
    """The names of the placeholders (without a default) that running ``ops`` needs and
    ``feed`` does not give: what the run would fail on ("You must feed a value")."""
    fed = {getattr(t, "name", t) for key in feed
           for t in tf.nest.flatten(key, expand_composites=True)}
    missing, seen, stack = set(), set(), list(ops)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type == "Placeholder":
            missing.add(op.name)
        stack.extend(t.op for t in op.inputs if t.name not in fed)
        stack.extend(op.control_inputs)
    return sorted(missing)


def _seed_inputs(op):
    """The seed and seed2 input tensors of a ``tf.data`` op (or seed generator) that
    takes them, else None."""
    if "Dataset" not in op.type and "SeedGenerator" not in op.type:
        return None
    args = op.op_def.input_arg
    names = [a.name for a in args]
    if "seed" not in names or "seed2" not in names:
        return None
    if any(a.number_attr or a.type_list_attr for a in args[:names.index("seed2")]):
        return None  # a list input before them: the input indices are not the arguments'
    return op.inputs[names.index("seed")], op.inputs[names.index("seed2")]


def _pipeline_functions(graph):
    """The FunctionDefs that the graph's ``tf.data`` ops call (map, filter, interleave
    functions, a one-shot iterator's factory), and those they call, in the order found."""
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    called = graph_lib.called_functions
    queue = [name for op in graph.get_operations()
             if "Dataset" in op.type or "Iterator" in op.type for name in called(op.node_def)]
    found = {}
    while queue:
        name = queue.pop(0)
        if name in library and name not in found:
            found[name] = library[name]
            queue += [n for node in library[name].node_def for n in called(node)]
    return list(found.values())


def _every(program):
    """The names of the ``ms.every`` conds the program's fetches reach."""
    conds = program.graph.get_collection(EVERY)
    reached = graph_lib.ancestors([t if isinstance(t, tf.Operation) else t.op
                                   for t in tf.nest.flatten(program.fetch)]) if conds else ()
    return tuple(op.name for op in conds if op in reached)


def _random_ops(program):
    """The stateful random ops a fused run depends on, once per op of a step (step k
    written ``step_k``)."""
    found = graph_lib.stateful_random_ops(graph_lib.ancestors([getattr(program.fetch[0], "op", program.fetch[0])]))
    return tuple(dict.fromkeys(re.sub(r"/step_\d+/", "/step_k/", what) for what in found))


def _data_order(fused, single):
    """Why the two builds may read their data in different orders, or None: their
    input pipelines draw at random unseeded, or with seeds that differ between them."""
    a, b = fused.data_seeds(), single.data_seeds()
    unseeded = sorted({what for what, seeds in a + b if seeds == (0, 0)})
    if unseeded:
        why = f"{', '.join(unseeded)} without a seed: each build draws its own"
    elif [seeds for _, seeds in a] != [seeds for _, seeds in b]:
        why = f"with seeds that differ between the {fused.steps}-step and the 1-step build"
    else:
        return None
    return (f"data order: the two builds read their data in different orders (their input "
            f"pipeline draws at random, {why}), so this divergence may come from the data "
            f"alone and is no verdict on the training code. Fix: seed the pipeline, seed= on "
            f"its shuffle and random ops (dataset.shuffle(buffer, seed=0)), or call "
            f"tf.compat.v1.set_random_seed(0) inside build_fn (verify builds each model in a "
            f"fresh graph, which a seed set outside build_fn does not reach), and verify again")


def _name(variable):
    return variable.name[:-2] if variable.name.endswith(":0") else variable.name


def _matching_names(fused, single):
    """The variable names of both graphs, matched: by name, and where a name differs
    only in a number that Keras counts per process (``seed_generator_1`` against
    ``seed_generator``), by that role and the order the variables were made in."""
    a, b = set(fused.variables), set(single.variables)
    if a != b:
        renamed = _match_by_role([n for n in fused.variables if n not in b],
                                 [n for n in single.variables if n not in a])
        if renamed:
            for fused_name, single_name in renamed.items():
                fused.rename(fused_name, single_name)
            a = set(fused.variables)
    if a != b:
        raise ValueError(
            f"the {fused.steps}-step and 1-step graphs have different variables "
            f"(only in {fused.steps}-step: {sorted(a - b)}; only in 1-step: "
            f"{sorted(b - a)}), and they do not pair up by role either (the same names "
            f"but for Keras's per-process counters, made in the same order). build_fn must "
            f"build the same variables whatever steps it is given; naming the layers "
            f"explicitly makes a mismatch easier to read.")
    for n in a:
        if fused.variables[n].shape != single.variables[n].shape:
            raise ValueError(f"variable {n!r} has shape {fused.variables[n].shape} in the "
                             f"{fused.steps}-step graph and {single.variables[n].shape} in the 1-step graph.")
    return sorted(a)


def _role(name):
    return re.sub(r"_\d+(?=/|$)", "", name)


def _match_by_role(fused_only, single_only):
    """fused name -> single name, when the unmatched names pair up one to one by role
    (the name without per-process counters) in creation order; else None."""
    if len(fused_only) != len(single_only) or not fused_only:
        return None
    if [_role(n) for n in fused_only] != [_role(n) for n in single_only]:
        return None
    return dict(zip(fused_only, single_only))
