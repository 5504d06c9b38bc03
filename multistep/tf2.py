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
(``multistep.lint.check_captures``), and the Python-side state a trace freezes. ``verify``
compares N fused steps with N single calls of ``tf.function(step_fn)``, bitwise, with
the TF1 verifier's comparison.
"""

import dataclasses
import inspect
import numbers
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from multistep import lint
from multistep.verify import _max_abs_diff, _same_bits

__all__ = ["Finding", "Fused", "check", "fuse", "verify"]


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
    if optimizer is not None and not _is_optimizer(optimizer):
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
        if _is_iterator(batches):
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
                found = _random_ops(concrete.graph)
                if found:
                    warnings.warn(_random_under_xla_message(found), RuntimeWarning,
                                  stacklevel=lint.user_stacklevel())
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
        out = _as_outputs(returned)
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
        written = _written_variables(body)
        if not frozen:
            return _stale_findings(body, written)
        roots = _referenced(self.step_fn) + [self.optimizer]
        findings = _capture_findings(body, written, constants=_held_constants(roots))
        found = _random_ops(body) if self.jit_compile else []
        return findings + ([Finding("random", _random_under_xla_message(found))] if found else [])


@dataclasses.dataclass(frozen=True)
class Finding:
    """One trap ``check`` found: what, where, and the fix."""

    kind: str  # "stale", "frozen" or "python_state"
    message: str

    @property
    def stale(self):
        return self.kind == "stale"

    def __str__(self):
        return self.message


def check(fused, *args):
    """The traps in a training loop's body, before anything runs (it traces, which creates
    the variables a lazily built model makes): a list of ``Finding``.

    ``fused``: what ``ms.tf2.fuse`` returned, called as ``check(fused, batches)``; or any
    ``tf.function`` whose body has a ``tf.while_loop`` (a hand-written ``for i in
    tf.range(n)`` training loop), called as ``check(fn, *its_arguments)``: every loop in
    it is checked for the first two kinds.

    - ``stale``: the loop uses a value computed before it from a read of a variable the
      loop writes (evaluated once per call, so every step reuses the first value); the
      message names the line that built it.
    - ``frozen``: the loop uses a float value captured from Python or eager code (a
      constant in every step and every call; harmless for data, wrong for anything
      computed from the weights, such as a gradient or an L2 term computed eagerly); the
      message names the line that uses it. A tensor that an optimizer, a learning-rate
      schedule or a layer holds as an attribute (a schedule's ``tf.cast(d_model,
      tf.float32)``) is a constant it was built with, not reported.
    - ``python_state`` (``ms.tf2.fuse`` only): two traces of ``step_fn`` differ in a
      constant: Python state (a counter, a float attribute) that each trace freezes at
      its value then.
    """
    if not isinstance(fused, Fused):
        if not hasattr(fused, "get_concrete_function"):
            raise TypeError(f"check takes what ms.tf2.fuse returned, or a tf.function with a "
                            f"loop; got {type(fused).__name__}.")
        graph = fused.get_concrete_function(*args).graph
        bodies = _loop_bodies(graph)
        if not bodies:
            raise ValueError(f"check: {getattr(fused, '__name__', fused)!r} has no "
                             f"tf.while_loop (a `for` over tf.range, traced by AutoGraph) to "
                             f"check; a loop in Python runs once per step of its own.")
        name = f"{getattr(fused, '__name__', 'the function')}'s loop"
        constants = _held_constants(_referenced(getattr(fused, "python_function", fused)))
        return [f for body in bodies for f in _capture_findings(
            body, _written_variables(body), name=name, constants=constants)]
    if len(args) != 1:
        raise TypeError("check(fused, batches): the batches, one argument.")
    [batches] = args
    if _is_iterator(batches):
        raise TypeError("check takes batches as tensors with a leading dimension N; take N "
                        "elements from the iterator first.")
    fused._check_leading(batches)
    fused._function.get_concrete_function(
        tf.nest.map_structure(tf.convert_to_tensor, batches), tf.constant(fused.steps))
    return fused.findings() + _python_state_findings(fused, batches)


def _as_outputs(returned):
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
        if not (lint.is_write(op) or op.type in lint.CALL_OPS):
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
        t = lint.source_op(t).outputs[0]
        outer = {inner.ref(): outer for outer, inner in getattr(t.graph, "captures", ())}
        t = outer.get(t.ref())
        if t is None:
            return None
    return t


def _loop_bodies(graph):
    """The bodies of the v2 loops in ``graph`` and in the loops and conds nested in it."""
    out, todo = [], [graph]
    while todo:
        for op in todo.pop().get_operations():
            nested = [getattr(op, attr, None) for attr in ("_body_graph", "_true_graph",
                                                           "_false_graph")]
            if op.type in ("While", "StatelessWhile") and nested[0] is not None:
                out.append(nested[0])
            todo += [g for g in nested if g is not None]
    return out


def _python_state_findings(fused, batches):
    batch = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), batches)
    graphs = [tf.function(lambda b: fused.step_fn(*fused._arguments(b)), autograph=False)
              .get_concrete_function(batch).graph for _ in range(2)]
    constants = [[(op, tf.make_ndarray(op.get_attr("value"))) for op in g.get_operations()
                  if op.type == "Const"] for g in graphs]
    findings = []
    for (op, a), (_, b) in zip(*constants):
        if a.shape != b.shape or not np.array_equal(a, b):
            findings.append(Finding("python_state", (
                f"step_fn's constant '{op.name}'{lint.built_at(op)} was {a.tolist()} in one "
                f"trace and {b.tolist()} in the next: Python state read in step_fn (a "
                f"counter, an attribute) is frozen at each trace, so every fused step reuses "
                f"one value. Keep it in a tf.Variable and update it inside step_fn.")))
    return findings


def _stale_findings(body, written, name="ms.tf2.fuse"):
    """The stale capture of the loop body (a FuncGraph), if any; ``name`` says whose."""
    try:
        lint.check_captures(body, written, name=name)
    except lint.StaleForwardError as error:
        return [Finding("stale", str(error))]
    return []


def _capture_findings(body, written, name="ms.tf2.fuse", constants=frozenset()):
    """Stale and frozen captures of the loop body (a FuncGraph); ``name`` says whose;
    ``constants``: ids of eager tensors that are constants by design (``_held_constants``)."""
    findings = _stale_findings(body, written, name)
    for outer, inner in body.captures:
        # (Only a float can be a value computed from the weights: integer labels, indices
        # and flags captured eagerly are data, not a trap.)
        if tf.is_symbolic_tensor(outer) or not outer.dtype.is_floating or id(outer) in constants:
            continue
        used = _used_at(inner)
        # (an eager value's placeholder is named by a number: no name to show)
        named = "" if inner.op.name.rsplit("/", 1)[-1].isdigit() else f" as '{inner.op.name}'"
        findings.append(Finding("frozen", (
            f"{name}: the loop uses a value computed before the call (shape {outer.shape}, "
            f"{outer.dtype.name}), captured{named}{used}: the same in every "
            f"step and every call. Data may be; anything computed from the weights (a "
            f"gradient, an L2 term) must be computed inside the loop. (A value an optimizer, "
            f"a schedule or a layer holds as an attribute is a constant, not reported.)")))
    return findings


def _used_at(tensor, depth=3):
    """`` at FILE:LINE (in FUNCTION)`` of the user's first op that uses ``tensor``: through
    the functions it is passed to (a ``tf.function`` step, called inside the loop), whose
    own ops were built at the user's lines; "" if none."""
    for op in tensor.consumers():
        where = lint.built_at(op)
        if op.type in ("PartitionedCall", "StatefulPartitionedCall") and depth:
            inner = _called_input(op, tensor)
            where = (inner is not None and _used_at(inner, depth - 1)) or where
        if where:
            return where
    return ""


def _called_input(op, tensor):
    """The input placeholder of the function ``op`` calls that receives ``tensor``."""
    name, graph, function = op.get_attr("f").name, op.graph, None
    while graph is not None and function is None:
        function = getattr(graph, "_functions", {}).get(name)
        graph = getattr(graph, "outer_graph", None)
    inputs = getattr(getattr(function, "graph", None), "inputs", [])
    index = next((i for i, t in enumerate(op.inputs) if t.name == tensor.name), None)
    return inputs[index] if index is not None and index < len(inputs) else None


def _writes(graph, depth=3):
    """(op, the written handle in ``graph``) of each variable write in ``graph`` and in
    the functions it calls (the call op, and its input that the function writes)."""
    out = []
    for op in graph.get_operations():
        if lint.is_write(op):
            out.append((op, op.inputs[0]))
        elif op.type in ("PartitionedCall", "StatefulPartitionedCall") and depth:
            name, outer, function = op.get_attr("f").name, graph, None
            while outer is not None and function is None:
                function = getattr(outer, "_functions", {}).get(name)
                outer = getattr(outer, "outer_graph", None)
            inner = getattr(function, "graph", None)
            if inner is None:
                continue
            index = {t.name: i for i, t in enumerate(inner.inputs)}
            for _, handle in _writes(inner, depth - 1):
                i = index.get(lint.source_op(handle).outputs[0].name)
                if i is not None and i < len(op.inputs):
                    out.append((op, op.inputs[i]))
    return out


def _written_variables(body):
    """The variables the loop body writes: the op that holds each one's handle in the graph
    around the loop (what ``lint.check_captures`` walks) -> the writing op's name. The body
    captures a variable's handle from the graph around it, or straight from eager code
    (the handle of a variable made eagerly): then the graph around it holds its own."""
    around = {outer.ref(): inner for outer, inner in getattr(body.outer_graph, "captures", ())}
    outer_of = {inner.ref(): outer for outer, inner in body.captures}
    written = {}
    for op, handle in _writes(body):
        outer = outer_of.get(lint.source_op(handle).outputs[0].ref())
        if outer is not None and not tf.is_symbolic_tensor(outer):
            outer = around.get(outer.ref())
        if outer is not None:
            written[lint.source_op(outer)] = op.name
    return written


def _referenced(fn):
    """The objects ``fn`` refers to: its closure, the globals it names, and ``self`` of a
    bound method with that object's attributes (a Keras model's ``optimizer`` and its
    own); a ``tf.function``'s, those of the Python function it wraps."""
    owner = getattr(fn, "__self__", None)
    fn = getattr(fn, "python_function", fn)  # (a tf.function: the function it traces)
    owner = getattr(fn, "__self__", owner)
    code = getattr(fn, "__code__", None)
    found = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()
             if _has_cell_contents(c)]
    if code is not None:
        scope = getattr(fn, "__globals__", {})
        found += [scope[n] for n in code.co_names if n in scope]
    if owner is not None:
        found += [owner, getattr(owner, "optimizer", None)]
        found += [v for v in getattr(owner, "__dict__", {}).values() if _is_optimizer(v)]
    return found


def _is_optimizer(value):
    return hasattr(getattr(value, "iterations", None), "assign_add")


def _optimizers(step_fn, depth=3):
    """The objects with an ``iterations`` variable that ``step_fn`` refers to
    (``_referenced``), or the functions it refers to do (a step that calls another), once
    each."""
    found, seen, todo = {}, set(), [(step_fn, 0)]
    while todo:
        fn, level = todo.pop()
        if id(fn) in seen or level > depth:
            continue
        seen.add(id(fn))
        for value in _referenced(fn):
            if _is_optimizer(value):
                found[id(value)] = value
            elif inspect.isfunction(value) or inspect.ismethod(value) or hasattr(
                    value, "python_function"):
                todo.append((value, level + 1))
    return list(found.values())


def _held_constants(roots, depth=4):
    """The ids of the eager tensors that an optimizer, a learning-rate schedule, a layer or
    a ``tf.Module`` among ``roots`` (or that the functions among them refer to) holds as an
    attribute, theirs in turn: values they were built with (a Transformer schedule's
    ``tf.cast(d_model, tf.float32)``), constants of every step by design, not values
    computed from the weights before the loop."""
    import keras  # (Keras 3: the objects a TF2 step holds)

    kinds = (keras.optimizers.Optimizer, keras.optimizers.schedules.LearningRateSchedule,
             keras.layers.Layer, tf.Module)

    def functions(value):  # a function the step calls: what it refers to is the step's
        return inspect.isfunction(value) or inspect.ismethod(value)

    roots = [r for r in roots if isinstance(r, kinds) or functions(r)]
    held, seen, todo = set(), set(), [(r, 0) for r in roots]
    while todo:
        obj, level = todo.pop()
        if id(obj) in seen or level > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, kinds):
            values = list(vars(obj).values())
        elif functions(obj):
            values = _referenced(obj)
        else:
            values = list(obj.values()) if isinstance(obj, dict) else list(obj)
        for value in values:
            if isinstance(value, tf.Tensor) and not tf.is_symbolic_tensor(value):
                if not functions(obj):  # (a tensor a function refers to itself may be a trap)
                    held.add(id(value))
            elif isinstance(value, (*kinds, list, tuple, dict)) or functions(value):
                todo.append((value, level + 1))
    return held


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


def _has_cell_contents(cell):
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


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
    found = sorted({node.op for node in lint.program_nodes(graph)} & _CONVOLUTIONS)
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


def _random_ops(graph):
    """The stateful random ops (``tf.random.normal``, ``tf.nn.dropout``, ...) of ``graph``
    and of the functions it calls, as ``'name' (Type)`` strings, sorted."""
    found = set()
    for node in lint.program_nodes(graph):
        op_def = op_def_registry.get(node.op)
        if node.op in lint._STATEFUL_RANDOM_OPS or (  # noqa: SLF001 (the shared list)
                op_def is not None and op_def.is_stateful
                and {"seed", "seed2"} <= {a.name for a in op_def.attr}):
            found.add(f"'{node.name}' ({node.op})")
    return sorted(found)


def _random_under_xla_message(found):
    return (f"ms.tf2.fuse: jit_compile=True over a step with stateful random ops "
            f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): XLA draws their "
            f"numbers from a generator of its own for each compiled program, seeded or not, "
            f"so the fused steps draw other numbers than N single jit_compile=True calls, "
            f"from step 1. For the same numbers, fuse without jit_compile, or draw with "
            f"stateless ops seeded from a variable the step advances (a Keras layer's "
            f"keras.random.SeedGenerator, as keras.layers.Dropout(rate, seed=...) does, or "
            f"tf.random.stateless_normal(shape, seed=...)).")


def _is_distributed(value):
    """A value per replica (of a distributed iterator or dataset)."""
    return isinstance(value, tf.types.experimental.distributed.PerReplica)


def _shapes(element):
    """The shapes of ``element``'s tensors (of every replica's part, for values per
    replica)."""
    return [t.shape for t in tf.nest.flatten(element, expand_composites=True)]


def _is_iterator(value):
    return isinstance(value, (tf.data.Iterator, tf.distribute.DistributedIterator))


def verify(step_fn, steps, *, batches, calls=3, jit_compile=False, optimizer=None, atol=0.0):
    """N fused steps against N single calls of ``tf.function(step_fn)``, bitwise.

    Builds ``fuse(step_fn, steps, jit_compile=jit_compile)`` (its first trace creates the
    variables a lazily built model makes), snapshots every variable the fused steps use
    (the model's, the optimizer's slots and iteration, metrics, random generators' state),
    runs ``calls`` fused calls, restores the snapshot, runs ``steps * calls`` calls of
    ``tf.function(step_fn, jit_compile=jit_compile)`` on the same batches, compares every
    variable after each N steps and every step's outputs, and restores the snapshot again:
    the model is left as it was.

    Args:
      step_fn: as ``fuse``'s.
      steps: as ``fuse``'s.
      jit_compile: as ``fuse``'s.
      optimizer: as ``fuse``'s.
      batches: a nest of tensors with leading dimension ``steps * calls`` (call c takes
        ``[c * steps, (c + 1) * steps)``), or a ``tf.data.Dataset`` of single batches
        (the first ``steps * calls`` elements are taken).
      calls: fused calls to compare (>= 1).
      atol: allowed max |Δ|; 0.0 asks for bitwise equality.

    Returns:
      An ``ms.Report`` (as ``ms.verify``'s): ``runs`` counts the fused calls,
      ``per_variable`` has each variable and each per-step output (``"loss"``, ...),
      ``first_divergence`` is (call, name).
    """
    from multistep.verify import Report  # (the TF1 verifier's report)

    if isinstance(calls, bool) or not isinstance(calls, numbers.Integral) or calls < 1:
        raise ValueError(f"calls must be an int >= 1, got {calls!r}.")
    if isinstance(atol, bool) or not isinstance(atol, numbers.Real) or not atol >= 0:
        raise ValueError(f"atol must be a number >= 0, got {atol!r}.")
    fused = fuse(step_fn, steps, jit_compile=jit_compile, check=False, optimizer=optimizer)
    total = fused.steps * calls
    if batches is None or _is_iterator(batches) or inspect.isgenerator(batches):
        what = "None" if batches is None else type(batches).__name__
        raise TypeError(
            f"verify: batches must be tensors with a leading dimension of steps * calls = "
            f"{total} or a tf.data.Dataset of single batches, got {what}: verify feeds the "
            f"same batches to the fused and to the single steps, so it needs data it can "
            f"read twice. Pass the dataset itself, not iter(dataset).")
    if isinstance(batches, tf.data.Dataset):
        elements = list(batches.take(total))
        if len(elements) < total:
            raise ValueError(f"batches: the dataset has {len(elements)} elements, "
                             f"{total} needed (steps * calls).")
        batches = tf.nest.map_structure(lambda *xs: tf.stack(xs), *elements)
    batches = tf.nest.map_structure(tf.convert_to_tensor, batches)
    for t in tf.nest.flatten(batches):
        if t.shape.rank == 0 or t.shape[0] != total:
            raise ValueError(f"batches need a leading dimension of steps * calls = {total}, "
                             f"got shape {t.shape}.")

    def block(c):
        return tf.nest.map_structure(lambda t: t[c * fused.steps:(c + 1) * fused.steps], batches)

    concrete = fused._function.get_concrete_function(block(0), tf.constant(fused.steps))
    variables = _unique_names(concrete.variables)
    start = {name: tf.identity(v).numpy() for name, v in variables.items()}

    def values():
        return {name: v.numpy() for name, v in variables.items()}

    def restore():
        for name, v in variables.items():
            v.assign(start[name])

    fused_out, fused_values = [], []
    for c in range(calls):
        fused_out.append({k: v.numpy() for k, v in fused(block(c)).items()})
        fused_values.append(values())
    restore()
    single = tf.function(step_fn, jit_compile=jit_compile, autograph=False)
    single_out, single_values = [], []
    for c in range(calls):
        outs = []
        for k in range(fused.steps):
            batch = tf.nest.map_structure(lambda t: t[c * fused.steps + k], batches)
            out = _as_outputs(single(*fused._arguments(batch)))
            if fused.optimizer is not None and "iteration" not in out:
                out["iteration"] = fused.optimizer.iterations
            outs.append({key: np.asarray(value) for key, value in out.items()})
        single_out.append({key: np.stack([o[key] for o in outs]) for key in outs[0]})
        single_values.append(values())
    restore()

    per_variable, first, bitwise = {}, None, True
    for c in range(calls):
        pairs = [(n, fused_values[c][n], single_values[c][n]) for n in variables]
        pairs += [(key, fused_out[c][key], single_out[c][key].astype(fused_out[c][key].dtype))
                  for key in fused_out[c]]
        for name, a, b in pairs:
            name = "losses" if name == "loss" else name  # as ms.verify names them
            diff = _max_abs_diff(a, b)
            bitwise = bitwise and _same_bits(a, b)
            per_variable[name] = max(per_variable.get(name, 0.0), diff)
            if first is None and not diff <= atol:
                first = (c + 1, name)
    return Report(steps=fused.steps, runs=calls, atol=float(atol), per_variable=per_variable,
                  first_divergence=first, bitwise=bitwise,
                  fused_losses=_losses(fused_out), single_losses=_losses(single_out),
                  final_values=fused_values[-1], xla=jit_compile,
                  plain_max_abs_diff=None)


def _losses(outs):
    """Each step's ``"loss"`` over the calls' outputs; empty for a step without one."""
    return np.concatenate([o.get("loss", np.zeros([0], np.float32)) for o in outs])


def _unique_names(variables):
    """name -> variable, the names made unique (Keras 3 names a layer's kernel 'kernel')."""
    out = {}
    for v in variables:
        name = getattr(v, "path", None) or v.name.split(":")[0]
        unique, n = name, 1
        while unique in out:
            n += 1
            unique = f"{name}#{n}"
        out[unique] = v
    return out
