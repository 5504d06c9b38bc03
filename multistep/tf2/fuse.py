"""TensorFlow 2 and Keras 3: N training steps in one ``tf.function`` call.

A TF2 training step is a Python function (forward, ``GradientTape``, ``apply_gradients``)
that a ``tf.function`` runs once per call from Python; for a small model the call costs
more than the maths. ``fuse`` runs N of them in one call: a ``tf.while_loop`` whose body is
the step, traced once for all N steps, each step reading the variables the previous one
wrote (the loop carries the order). It returns every step's loss and scalars.

The trap is TF1's: a value computed before the loop and used inside it is a loop
invariant, evaluated once per call, so every step reuses it (a gradient computed before
the loop, applied N times; an L2 term of the weights before the call). ``check`` finds
those in the traced loop with the same capture check the TF1 builder uses
(``multistep.builder.lint.check_captures``), and the Python-side state a trace freezes. ``verify``
compares N fused steps with N single calls of ``tf.function(step_fn)``, bitwise, with
the TF1 verifier's comparison.
"""

import inspect
import numbers
import warnings

import tensorflow as tf

from multistep import graph as graph_lib
from multistep.builder import lint
from multistep.tf2.findings import (Finding, capture_findings, held_constants, is_optimizer,
                                    random_ops, random_under_xla_message, referenced,
                                    stale_findings, written_variables)

__all__ = ['Fused', 'fuse']


def fuse(step_fn, steps, *, jit_compile=False, check=True, optimizer=None, strategy=None,
         reduce="sum"):
    """N calls of ``step_fn`` in one ``tf.function`` call.

    Args:
      step_fn: ``step_fn(batch) -> loss``, ``-> {name: scalar, ...}`` (logs as they are,
        with or without a ``"loss"``: a Keras ``train_step``'s ``d_loss``/``g_loss``) or
        ``-> None``: one training step (forward, tape, ``optimizer.apply_gradients``), as
        you would decorate with ``tf.function`` (a ``tf.function`` is taken too), or
        ``step_fn(x, y)`` for batches ``(xs, ys)``. Variables (a Keras model built lazily,
        the optimizer's slots) may be created on the first call.
      steps: N >= 1, the steps of one call.
      jit_compile: compile the N steps as one XLA program. Its reference is N single
        ``tf.function(step_fn, jit_compile=True)`` calls, and what holds against them is
        less than without XLA (measure it: ``verify(..., jit_compile=True)``):

        - Dense layers, batch normalization, Keras layers' own randomness
          (``keras.layers.Dropout(rate, seed=...)``: stateless ops seeded from a
          ``SeedGenerator`` variable) and the Keras optimizers: bitwise with the single
          XLA calls in this project's tests.
        - Convolutions on the CPU: not promised bitwise. XLA rounds them otherwise than
          TensorFlow's kernels, and compiles N steps as one program, which it may fuse
          otherwise than one step (a VAE: 9.8e-4 after a few steps); and they can be
          several times slower. A warning at the first call says so.
        - Stateful random ops (``tf.random.normal``, ``tf.random.uniform``,
          ``tf.nn.dropout``, seeded or not): different numbers from step 1, since XLA
          draws them from a generator of its own per compiled program. A warning at the
          first call names them and ``check`` reports them (kind ``"random"``); draw with
          stateless ops seeded from a variable the step advances, or fuse without XLA.
        - A ``tf.data`` iterator is read outside the XLA program (one block of N
          elements per call), and ``jit_compile=True`` under a strategy is refused.
      check: True: on the first call, refuse (``ms.StaleForwardError``) a loop that
        captures a value computed before it from a variable the loop writes (see
        ``check``); False: don't.
      optimizer: the optimizer whose ``iterations`` the output ``"iteration"`` reads;
        default: of the objects with an ``iterations`` variable that ``step_fn`` refers
        to (in its closure, by a global name, or as an attribute of ``self`` of a bound
        method such as a Keras model's ``train_step``; through a ``tf.function``), the
        one whose iteration the traced step advances (not a bare ``compile()``'s unused
        default); none, or several (a GAN's two), no ``"iteration"``.
      strategy: a ``tf.distribute`` strategy (MirroredStrategy): each step runs
        ``strategy.run(step_fn, (batch,))``, the loop staying outside ``strategy.run``;
        replica r takes its share of each step's batch (the leading, batch dimension
        split evenly in replica order), and the step's outputs are reduced across the
        replicas with ``reduce`` (``"sum"``: what a loss scaled by the global batch size,
        ``tf.nn.compute_average_loss``, adds up to; or ``"mean"``). Without XLA:
        ``jit_compile=True`` under a strategy is refused. ``batches`` may then be a
        distributed iterator (``iter(strategy.experimental_distribute_dataset(ds))``):
        each element holds every replica's part, and replica r takes its part of step k.

    Returns:
      A ``Fused``: ``fused(batches)`` runs the steps and returns a dict of ``[n]``
      tensors, one value per step: the step's scalars (``"loss"``, ...), and
      ``"iteration"`` (the optimizer's iteration count after each step, where the
      step's variables include a Keras optimizer's ``iteration``). ``batches``: a nest
      of tensors whose leading dimension is N (step k takes slice k), or a
      ``tf.data`` iterator (N elements, in order; fewer if it runs out: ``n`` is then
      the number taken, said by a warning, with no retrace). Where its elements all have
      the same, known shapes (``batch(n, drop_remainder=True)``, ``from_tensor_slices``)
      and without XLA or a strategy, the fused call takes them itself, one ``get_next``
      a step (as Keras's ``steps_per_execution``); else they are taken and stacked
      before it. An element whose shapes
      differ from the fused steps' (a short last batch, a ``padded_batch`` of its own
      length) ends the call: it runs as one single step traced for its shapes, as a
      single-step ``tf.function`` retraces for it, and a warning says so (under a
      strategy: a ``ValueError`` naming it, after the steps before it).

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> w = tf.Variable(1.0)
      >>> opt = tf.keras.optimizers.SGD(0.25)
      >>> def step(batch):
      ...     with tf.GradientTape() as tape:
      ...         loss = w * w * batch
      ...     opt.apply_gradients([(tape.gradient(loss, w), w)])
      ...     return loss
      >>> fused = ms.tf2.fuse(step, steps=3)
      >>> out = fused(tf.ones([3]))
      >>> out["loss"].numpy().tolist(), out["iteration"].numpy().tolist(), float(w.numpy())
      ([1.0, 0.25, 0.0625], [1, 2, 3], 0.125)
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable (batch -> loss or dict), got {step_fn!r}.")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}.")
    if not isinstance(jit_compile, bool):
        raise TypeError(f"jit_compile must be True or False, got {jit_compile!r}.")
    if not isinstance(check, bool):
        raise TypeError(f"check must be True or False (refuse a stale capture at the first "
                        f"call, or not), got {check!r}.")
    if reduce not in ("sum", "mean"):
        raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}.")
    if strategy is not None:
        if not isinstance(strategy, tf.distribute.Strategy):
            raise TypeError(f"strategy must be a tf.distribute.Strategy, got {strategy!r}.")
        if jit_compile:
            raise ValueError(
                "ms.tf2.fuse: jit_compile=True under a tf.distribute strategy is refused: one "
                "XLA program is compiled for one device, and a Keras variable of the second "
                "replica then fails (InvalidArgumentError: Trying to access resource ... located "
                "in device ... replica_1). Fuse under the strategy without XLA.")
    if optimizer is not None and not is_optimizer(optimizer):
        raise TypeError(f"optimizer must be the optimizer step_fn applies (one with an "
                        f"iterations variable), got {type(optimizer).__name__}: pass "
                        f"model.optimizer, not the model.")
    return Fused(step_fn, int(steps), jit_compile, check, optimizer, strategy, reduce)


class Fused:
    """``fuse``'s result: call it with N steps' batches (see ``fuse``)."""

    def __init__(self, step_fn, steps, jit_compile, check, optimizer, strategy=None,
                 reduce="sum"):
        self.step_fn, self.steps, self.jit_compile, self._check = step_fn, steps, jit_compile, check
        self.optimizer, self.strategy, self.reduce = optimizer, strategy, reduce
        # Without optimizer=: the optimizers step_fn refers to, of which the trace keeps the
        # one whose iteration the step writes (_applied).
        self._candidates = None if optimizer is not None else _optimizers(step_fn)
        self._bodies = []  # the loop body's FuncGraph, from the trace
        self._positional = _positional_parameters(step_fn)
        # The step as a function of its own inside the loop, as a single call runs it: the
        # graph optimizer then rewrites it as it rewrites the single step's (inlined in the
        # loop body, its gradient sums were rewritten otherwise: a GAN's discriminator,
        # called on real and fake, got other gradients from step 3).
        # (Under a strategy, called in each replica as written: Keras's optimizer refuses
        # a function of its own there.)
        self._step_function = (step_fn if strategy is not None
                               or hasattr(step_fn, "get_concrete_function") else
                               tf.function(step_fn, autograph=False))
        self._traces = 0
        self._signature = None  # the batches' TensorSpecs of the first call
        self._source = None  # and their kind: "tensors" or "iterator" (_in_graph)
        self._single = None  # one step, for an element of other shapes (_call_iterator)
        self._function = tf.function(self._program, jit_compile=jit_compile, autograph=False)

    def __call__(self, batches):
        if isinstance(batches, tf.distribute.DistributedIterator) and self.strategy is None:
            raise TypeError("ms.tf2.fuse: a distributed iterator (iter(strategy."
                            "experimental_distribute_dataset(...))) needs the strategy: "
                            "fuse(step_fn, N, strategy=strategy).")
        if is_iterator(batches):
            if self._in_graph(batches):
                return self._run(batches)
            return self._call_iterator(batches)
        if batches is None or isinstance(batches, tf.data.Dataset) or inspect.isgenerator(batches):
            what = "None" if batches is None else type(batches).__name__
            raise TypeError(
                f"ms.tf2.fuse: batches must be tensors with a leading dimension of "
                f"steps={self.steps} (step k takes slice k) or a tf.data iterator, got {what}. "
                f"For a dataset, pass iter(dataset) (each call takes its next {self.steps} "
                f"elements), or dataset.batch({self.steps}) elements.")
        self._check_leading(batches)
        return self._run(batches)

    def _in_graph(self, iterator):
        """Whether the loop takes its steps' elements from ``iterator`` itself (one
        ``get_next`` a step inside the call, as Keras's ``steps_per_execution`` does): a
        ``tf.data`` iterator whose elements all have the same, known shapes, without XLA
        (which has no kernel for the iterator) or a strategy. Else ``_call_iterator``."""
        if self.jit_compile or self.strategy is not None or not isinstance(
                iterator, tf.data.Iterator):
            return False
        specs = tf.nest.flatten(iterator.element_spec, expand_composites=False)
        return all(isinstance(spec, tf.TensorSpec) and spec.shape.is_fully_defined()
                   for spec in specs) and self._source != "tensors"

    def _run(self, batches, count=None):
        from_iterator = isinstance(batches, tf.data.Iterator)
        if from_iterator:  # (the same steps' signature as N stacked elements)
            signature = tf.nest.map_structure(
                lambda spec: tf.TensorSpec([self.steps, *spec.shape], spec.dtype),
                batches.element_spec)
        else:
            batches = tf.nest.map_structure(
                lambda t: t if _is_distributed(t) else tf.convert_to_tensor(t), batches)
            signature = tf.nest.map_structure(tf.type_spec_from_value, batches)
        source = "iterator" if from_iterator else "tensors"
        if self._signature is None:
            self._signature, self._source = signature, source
        elif signature != self._signature or source != self._source:
            raise RuntimeError(
                f"ms.tf2.fuse: these batches ({source}: {signature}) would trace the fused "
                f"steps again (first traced for {self._source}: {self._signature}). A second "
                f"trace would freeze step_fn's Python values anew and compile again; keep the "
                f"batches' kind (tensors or a tf.data iterator), structure, shapes and dtypes "
                f"(a tf.data input's last short block is run without a retrace).")
        count = tf.constant(self.steps if count is None else count)
        if self._traces == 0:  # trace (and check) before anything runs
            if self.strategy is not None:
                concrete = self._trace_without_creating_variables(batches, count)
            else:
                concrete = self._function.get_concrete_function(batches, count)
            if self.jit_compile:
                _warn_convolutions_under_xla(concrete.graph)
                found = random_ops(concrete.graph)
                if found:
                    warnings.warn(random_under_xla_message(found), RuntimeWarning,
                                  stacklevel=graph_lib.user_stacklevel())
            if self._check:
                findings = self.findings(frozen=False)
                if findings:
                    raise lint.StaleForwardError(str(findings[0]))
        traces = self._traces
        out, taken = self._function(batches, count)
        if self._traces != traces:  # a retrace not caught above: say so
            raise RuntimeError(f"ms.tf2.fuse: the fused steps were traced again (trace "
                               f"{self._traces}), though the batches' signature did not change.")
        if from_iterator:
            taken = int(taken)
            if taken == 0:
                raise tf.errors.OutOfRangeError(None, None, "ms.tf2.fuse: the input is exhausted.")
            if taken < self.steps:
                warnings.warn(f"ms.tf2.fuse: the input ran out: this call ran {taken} of its "
                              f"{self.steps} steps.", RuntimeWarning, stacklevel=3)
                out = {key: value[:taken] for key, value in out.items()}
        return out

    def _call_iterator(self, iterator):
        """The next N elements of ``iterator`` as one block. An element whose shapes
        differ from the block's (a short last batch of ``batch(n)``, a ``padded_batch``
        padded to its own longest) ends the block: the steps before it run fused, then it
        runs as one single step traced for its shapes (as a single-step ``tf.function``
        retraces for it), with a warning. Nothing past it is taken from the iterator."""
        elements, odd = [], None
        for _ in range(self.steps):
            element = iterator.get_next_as_optional()
            if not element.has_value():
                break
            value = element.get_value()
            if not self._fits(value, elements[0] if elements else None):
                odd = value
                break
            elements.append(value)
        count = len(elements)
        if count == 0 and odd is None:
            raise tf.errors.OutOfRangeError(None, None, "ms.tf2.fuse: the input is exhausted.")
        if odd is not None and self.strategy is not None:
            raise ValueError(self._odd_message(odd, elements, count))
        out = {}
        if count:
            if count < self.steps and odd is None:
                warnings.warn(f"ms.tf2.fuse: the input ran out: this call ran {count} of its "
                              f"{self.steps} steps.", RuntimeWarning, stacklevel=3)
            # The same shapes as a full block (no retrace): the missing steps repeat the
            # last element and are not run (the loop stops at count).
            padded = elements + [elements[-1]] * (self.steps - count)
            batches = self._stack(padded)
            out = {key: value[:count] for key, value in self._run(batches, count).items()}
        if odd is not None:
            warnings.warn(self._odd_message(odd, elements, count), RuntimeWarning, stacklevel=3)
            if self._single is None:
                self._single = tf.function(self._outputs, jit_compile=self.jit_compile,
                                           autograph=False)
            one = self._single(odd)
            out = {key: tf.concat([out[key], value[None]], 0) if key in out else value[None]
                   for key, value in one.items()}
        return out

    def _stack(self, elements):
        """N elements as one block, each tensor with a leading dimension N; elements of a
        distributed iterator (values per replica): each replica's N parts stacked, as
        values per replica again."""
        if not any(_is_distributed(t) for t in tf.nest.flatten(elements[0])):
            return tf.nest.map_structure(lambda *xs: tf.stack(xs), *elements)
        local = self.strategy.experimental_local_results
        stacked = [tf.nest.map_structure(lambda *xs: tf.stack([local(x)[r] for x in xs]),
                                         *elements)
                   for r in range(self.strategy.num_replicas_in_sync)]
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: stacked[context.replica_id_in_sync_group])

    def _odd_message(self, odd, elements, count):
        shapes = [tuple(shape) for shape in _shapes(odd)]
        want = ([tuple(shape) for shape in _shapes(elements[0])] if elements else
                [tuple(spec.shape[1:])
                 for spec in tf.nest.flatten(self._signature, expand_composites=True)])
        what = (f"ms.tf2.fuse: the input's next element has shapes {shapes}, where the fused "
                f"steps take {want}: a short last batch (batch(n, drop_remainder=True) drops "
                f"it) or variable-length batches (padded_batch pads each to its own longest: "
                f"give padded_shapes= a fixed length). ")
        if self.strategy is not None:
            return what + (f"Under a strategy it is not trained: this call ran the {count} "
                           f"step(s) before it, that element was taken from the iterator and "
                           f"nothing after it was.")
        return what + (f"This call ran the {count} step(s) before it fused, then that element "
                       f"as one single step traced for its shapes (as a single-step "
                       f"tf.function retraces for it); nothing after it was taken.")

    def _fits(self, element, first):
        """Whether ``element`` has the shapes of ``first`` (the block's first element) and
        of the steps traced so far."""
        shapes = _shapes(element)
        if first is not None and shapes != _shapes(first):
            return False
        if self._signature is not None:
            traced = [spec.shape[1:]
                      for spec in tf.nest.flatten(self._signature, expand_composites=True)]
            return len(traced) == len(shapes) and all(
                a.is_compatible_with(b) for a, b in zip(traced, shapes))
        return True

    def _check_leading(self, batches):
        for t in tf.nest.flatten(batches):
            shape = tf.convert_to_tensor(t).shape
            if shape.rank == 0 or (shape[0] is not None and shape[0] != self.steps):
                raise ValueError(
                    f"ms.tf2.fuse: batches need a leading dimension of steps={self.steps} "
                    f"(step k takes slice k), got shape {shape}.")

    def _program(self, batches, count):
        """All N steps in one loop body: ``step_fn`` traced once, so each op of the step
        (a stateful random op, ``tf.nn.dropout``) is one kernel, run N times as N single
        calls of one ``tf.function`` run theirs, and Python state read in the step is
        frozen once, as one trace of the single step freezes it. The outputs' keys and
        dtypes are known only once the body is traced: each step writes its scalars as one
        float64 vector (exact for float32 and for integers below 2^53) into a TensorArray
        whose element shape the body sets, and they are split and cast back after it.

        ``batches``: N steps' tensors (step k takes slice k), or a ``tf.data`` iterator
        (``_in_graph``): then the loop carries the next element as an optional, taken at
        the end of the step before (none after step N, so no element is taken beyond the
        call's), and stops early where the input runs out. Returns the outputs and the
        number of steps run."""
        self._traces += 1
        count = tf.convert_to_tensor(count, tf.int32)
        kinds = {}  # key -> dtype, in the order written
        iterator = batches if isinstance(batches, tf.data.Iterator) else None

        def take(k):  # the next element, if step k is to run
            return tf.cond(k < count, iterator.get_next_as_optional,
                           lambda: tf.experimental.Optional.empty(iterator.element_spec))

        def body(k, count, written, *element):
            graph = tf.compat.v1.get_default_graph()
            self._bodies.append(graph)
            with graph.name_scope(None):  # the names a single call gives (slots, layers)
                out = (self._outputs(element[0].get_value()) if iterator is not None
                       else self._step(batches, k))
            kinds.clear()
            kinds.update((key, out[key].dtype) for key in sorted(out))
            row = (tf.stack([tf.cast(out[key], tf.float64) for key in kinds]) if kinds
                   else tf.zeros([0], tf.float64))  # (a step with no outputs)
            element = (take(k + 1),) if iterator is not None else ()
            return (k + 1, count, written.write(k, row), *element)

        def more(k, count, written, *element):
            return tf.logical_and(k < count, element[0].has_value()) if element else k < count

        # One iteration at a time: step k+1 reads what step k wrote. (count is a loop
        # variable, not a capture: under a strategy a captured argument went unfed.)
        rows = tf.TensorArray(tf.float64, size=self.steps, infer_shape=False)
        first = (take(tf.constant(0)),) if iterator is not None else ()
        k, _, rows, *_ = tf.while_loop(more, body, (tf.constant(0), count, rows, *first),
                                       maximum_iterations=self.steps, parallel_iterations=1,
                                       name="fused_steps")
        table = tf.cond(k > 0, rows.stack,  # (none written: an input exhausted before)
                        lambda: tf.zeros([self.steps, len(kinds)], tf.float64))
        return ({key: tf.cast(table[:, j], dtype) for j, (key, dtype) in enumerate(kinds.items())},
                k)

    def _step(self, batches, k):
        if any(_is_distributed(t) for t in tf.nest.flatten(batches)):  # each replica its own
            return self._outputs(batches, k)
        return self._outputs(tf.nest.map_structure(lambda t: tf.gather(t, k), batches))

    def _outputs(self, batch, k=None):
        """step_fn on ``batch``: its outputs as a dict of scalars, with ``"iteration"``
        (``k``: ``batch`` holds values per replica of N steps, and this is step k)."""
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        try:
            returned = (self._call(batch) if self.strategy is None
                        else self._replicated(batch, k))
        except tf.errors.OperatorNotAllowedInGraphError as error:
            raise TypeError(
                f"ms.tf2.fuse traces step_fn without AutoGraph (autograph=False), so a Python "
                f"`if`, `for` or `while` on a tensor in it cannot run: {error}. Write it with "
                f"tf.cond / tf.where / tf.while_loop, or decorate step_fn with tf.function "
                f"(autograph converts it) and pass that.") from error
        out = as_outputs(returned)
        if self._candidates is not None:  # the trace shows which optimizer the step applies
            self.optimizer = _applied(self._candidates, graph.get_operations()[before:])
        if self.optimizer is not None and "iteration" not in out:
            out["iteration"] = tf.cast(tf.convert_to_tensor(self.optimizer.iterations), tf.int64)
        return out

    def _call(self, batch):
        """step_fn on one step's batch (a replica's share, under a strategy)."""
        return self._step_function(*self._arguments(batch))

    def _arguments(self, batch):
        """step_fn's arguments for one step's batch: the batch, or its items where step_fn
        takes as many (``train_step(x, y)`` with ``(xs, ys)``)."""
        if isinstance(batch, (tuple, list)) and self._positional == len(batch) > 1:
            return tuple(batch)
        return (batch,)

    def _trace_without_creating_variables(self, batches, count):
        """Under a strategy, trace first and refuse a step that creates variables: made in
        the fused function's first trace, a replica's variable went unfed at run time.
        Returns the concrete function."""
        created = []

        def creator(next_creator, **kwargs):
            created.append(kwargs.get("name"))
            return next_creator(**kwargs)

        failed = None
        with tf.variable_creator_scope(creator):
            try:
                concrete = self._function.get_concrete_function(batches, count)
            except Exception as error:  # (TensorFlow's own: an UnliftableError, say)
                if not created:
                    raise
                failed = error
        if created:
            raise ValueError(
                f"ms.tf2.fuse under {type(self.strategy).__name__}: step_fn created variables "
                f"on its first call ({', '.join(map(str, created[:3]))}"
                f"{', ...' if len(created) > 3 else ''}), which a fused function cannot do under "
                f"a strategy. Create them first, under strategy.scope(): build the model "
                f"(model.build(...) or one call) and the optimizer "
                f"(optimizer.build(model.trainable_variables)).") from failed
        return concrete

    def _replicated(self, batch, k=None):
        """``strategy.run(step_fn)`` on this step's batch, replica r taking its share (``k``:
        ``batch`` is a distributed iterator's N elements, values per replica, and replica r
        takes its part of element k); the outputs reduced across the replicas."""
        strategy = self.strategy
        how = tf.distribute.ReduceOp.SUM if self.reduce == "sum" else tf.distribute.ReduceOp.MEAN
        if k is not None:
            per_replica = strategy.run(
                lambda part: self._call(tf.nest.map_structure(lambda t: tf.gather(t, k), part)),
                (batch,))
            return tf.nest.map_structure(lambda v: strategy.reduce(how, v, axis=None),
                                         per_replica)
        replicas = strategy.num_replicas_in_sync

        def share(context):
            r = context.replica_id_in_sync_group

            def part(t):
                size = t.shape[0]
                if size is None or size % replicas:
                    raise ValueError(f"ms.tf2.fuse: a step's batch of {size} cannot be split "
                                     f"evenly over {replicas} replicas.")
                return t[r * (size // replicas):(r + 1) * (size // replicas)]
            return tf.nest.map_structure(part, batch)

        per_replica = strategy.run(
            self._call, (strategy.experimental_distribute_values_from_function(share),))
        return tf.nest.map_structure(lambda v: strategy.reduce(how, v, axis=None), per_replica)

    def findings(self, *, frozen=True):
        """The traps found in the traced loop (``check``); needs a call or a trace first.
        ``frozen=False``: the stale ones only (what a first call refuses)."""
        if not self._bodies:
            return []
        body = self._bodies[-1]
        written = written_variables(body)
        if not frozen:
            return stale_findings(body, written)
        roots = referenced(self.step_fn) + [self.optimizer]
        findings = capture_findings(body, written, constants=held_constants(roots))
        found = random_ops(body) if self.jit_compile else []
        return findings + ([Finding("random", random_under_xla_message(found))] if found else [])


def as_outputs(returned):
    """What step_fn returned as a dict of scalar tensors: a loss, a dict of logs as they are
    (a Keras ``train_step``'s, with or without a ``"loss"``), or nothing (``{}``)."""
    if returned is None:  # a step that returns nothing (the DCGAN tutorial's)
        return {}
    out = dict(returned) if isinstance(returned, dict) else {"loss": returned}
    for key, value in out.items():
        try:
            value = tf.convert_to_tensor(value)
        except (TypeError, ValueError) as error:
            raise TypeError(f"step_fn's {key!r} must be a number or a scalar tensor, got "
                            f"{type(value).__name__}: {error}") from None
        if not (value.dtype.is_floating or value.dtype.is_integer or value.dtype.is_bool):
            raise TypeError(f"step_fn's {key!r} must be a number or a scalar tensor (one value "
                            f"per step), got a {value.dtype.name} tensor. Return numbers only: "
                            f"text can be made from the outputs after the call.")
        if value.shape.rank != 0:
            raise ValueError(f"step_fn's {key!r} must be a scalar, got shape {value.shape}.")
        out[key] = value
    return out


def _applied(optimizers, ops):
    """The one optimizer among ``optimizers`` whose ``iterations`` variable ``ops`` (a
    step's trace) write or pass to a function they call (a ``tf.function`` step, a cond),
    else None: the optimizer a step trains through, not an unused one it also refers to
    (a bare ``compile()``'s default)."""
    handles = {id(_handle(o.iterations)): o for o in optimizers}
    applied = {}
    for op in ops:
        if not (graph_lib.is_write(op) or op.type in graph_lib.CALL_OPS):
            continue
        for t in op.inputs:
            if t.dtype == tf.resource:
                o = handles.get(id(_eager_source(t)))
                if o is not None:
                    applied[id(o)] = o
    return next(iter(applied.values())) if len(applied) == 1 else None


def _handle(variable):
    return getattr(variable, "handle", None)


def _eager_source(t):
    """The eager tensor (a variable's handle) that the graph tensor ``t`` was captured
    from, through the function graphs around it; else None."""
    while tf.is_symbolic_tensor(t):
        t = graph_lib.source_op(t).outputs[0]
        outer = {inner.ref(): outer for outer, inner in getattr(t.graph, "captures", ())}
        t = outer.get(t.ref())
        if t is None:
            return None
    return t


def _optimizers(step_fn, depth=3):
    """The objects with an ``iterations`` variable that ``step_fn`` refers to
    (``referenced``), or the functions it refers to do (a step that calls another), once
    each."""
    found, seen, todo = {}, set(), [(step_fn, 0)]
    while todo:
        fn, level = todo.pop()
        if id(fn) in seen or level > depth:
            continue
        seen.add(id(fn))
        for value in referenced(fn):
            if is_optimizer(value):
                found[id(value)] = value
            elif inspect.isfunction(value) or inspect.ismethod(value) or hasattr(
                    value, "python_function"):
                todo.append((value, level + 1))
    return list(found.values())


def _positional_parameters(step_fn):
    """How many positional parameters ``step_fn`` takes (None: any number, or unknown)."""
    try:
        parameters = inspect.signature(step_fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = [p.kind for p in parameters]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return None
    return sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
               for k in kinds)


# Convolutions: XLA compiles them with its own CPU kernels, not oneDNN's.
_CONVOLUTIONS = frozenset({
    "Conv", "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
    "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "DepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"})


def _warn_convolutions_under_xla(graph):
    """jit_compile=True on the CPU over a step with convolutions: say what it costs and
    what holds."""
    if tf.config.list_logical_devices("GPU"):
        return
    found = sorted({node.op for node in graph_lib.program_nodes(graph)} & _CONVOLUTIONS)
    if found:
        warnings.warn(
            f"ms.tf2.fuse: jit_compile=True on the CPU over a step with convolutions "
            f"({', '.join(found)}): XLA compiles them with its own CPU kernels, which round "
            f"otherwise than TensorFlow's, and compiles the N fused steps as one program, "
            f"which it may fuse and round otherwise than one step: the fused steps are close "
            f"to N single jit_compile=True calls, not promised bitwise with them "
            f"(verify(step_fn, N, batches=..., jit_compile=True) measures it: 9.8e-4 on a "
            f"conv VAE). They can also be several times slower (4-5x on a conv autoencoder "
            f"here: benchmarks/tf2_conv.py). Time it both ways; jit_compile=False keeps "
            f"TensorFlow's kernels and the bitwise promise.", RuntimeWarning, stacklevel=4)


def _is_distributed(value):
    """A value per replica (of a distributed iterator or dataset)."""
    return isinstance(value, tf.types.experimental.distributed.PerReplica)


def _shapes(element):
    """The shapes of ``element``'s tensors (of every replica's part, for values per
    replica)."""
    return [t.shape for t in tf.nest.flatten(element, expand_composites=True)]


def is_iterator(value):
    return isinstance(value, (tf.data.Iterator, tf.distribute.DistributedIterator))
