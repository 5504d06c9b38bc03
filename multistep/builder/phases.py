"""Several phases per inner step: a GAN's discriminator and generator updates, each its
own loss, optimizer and variables, in one fused step.

``ms.unroll([ms.phase(d_loss_fn, d_opt, var_list=D), ms.phase(g_loss_fn, g_opt,
var_list=G)], steps=N)`` builds N inner steps, each running the phases in order:

    phases="chained" (default)   phase p reads the variables after phase p-1's apply:
                                 the single step ``d_train = d_opt.minimize(d_loss)``, then
                                 ``g_train`` built under ``control_dependencies([d_train])``
    phases="simultaneous"        every phase's loss and gradients read the variables as
                                 the step found them, then every phase applies: the
                                 single step that computes both gradients, then applies
                                 both under ``control_dependencies`` of all of them

Why one ``ms.unroll`` and not one per optimizer: two fused train ops fetched in one
``sess.run`` are two chains of N steps with nothing ordering one against the other,
so which phase of which step reads which weights is left to the executor (a race);
one builder orders them. Each phase is a ``Step`` of its own (forward, update ops,
gradients, transforms, apply), the steps' machinery unchanged.
"""

import dataclasses
import warnings

import tensorflow as tf

from multistep import graph as graph_lib

__all__ = ["ORDERS", "Phase", "Phased", "phase"]

ORDERS = ("chained", "simultaneous")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of an inner step: ``loss_fn(*step_inputs)`` descended with ``optimizer``
    over ``var_list`` (default: the trainable variables its loss depends on)."""

    loss_fn: object
    optimizer: object
    var_list: object = None
    name: str = None


def phase(loss_fn, optimizer, *, var_list=None, name=None):
    """A phase of ``ms.unroll([...], steps)``: its loss function, optimizer and variables.

    ``var_list``: the variables it trains: a list, or a callable returning one, called
    after the phase's first ``loss_fn`` call (for variables that call creates, e.g.
    ``lambda: tf.compat.v1.trainable_variables("generator")``); default: every
    trainable variable its loss depends on.

    ``name`` names its scope (``multistep/step_k/<name>/forward``, ...) and its per-step
    losses, ``unrolled.records["loss/<name>"]``; default ``phase_1``, ``phase_2``, ...

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> with tf.Graph().as_default():
      ...     a, b = tf.Variable(1.0), tf.Variable(2.0)
      ...     sgd = tf.compat.v1.train.GradientDescentOptimizer
      ...     phases = [ms.phase(lambda: a * b, sgd(0.5), var_list=[a], name="a"),
      ...               ms.phase(lambda: a * b, sgd(0.5), var_list=[b], name="b")]
      ...     u = ms.unroll(phases, steps=2)
      ...     with tf.compat.v1.Session() as sess:
      ...         sess.run(tf.compat.v1.global_variables_initializer())
      ...         losses = sess.run([u.records["loss/a"], u.records["loss/b"]])
      ...         print(losses, *sess.run([a, b]))
      [array([2., 0.], dtype=float32), array([ 0., -2.], dtype=float32)] -1.0 2.5
    """
    if not callable(loss_fn):
        raise TypeError(f"ms.phase: loss_fn must be callable, got {type(loss_fn).__name__}.")
    return Phase(loss_fn, optimizer, var_list, name)


class Phased:
    """The phases' ``Step``s, built as one step; what ``ms.unroll`` asks of a step."""

    def __init__(self, steps, names, order):
        self.steps, self.names, self.order = steps, names, order
        self.record = tuple(f"loss/{n}" for n in names)  # the per-step outputs besides "loss"
        self.skipped = self.halt = self.next_carry = None
        self.carries = self.xla = self.halts = False

    @property
    def guard(self):
        return self.steps[0].guard  # one creation guard for every phase

    @property
    def label(self):
        return self.steps[0].label

    @label.setter
    def label(self, value):
        for step in self.steps:
            step.label = value

    @property
    def global_step(self):
        return self.steps[-1].global_step  # the last phase advances it, once a step

    @property
    def var_list(self):
        return tuple(v for step in self.steps for v in (step.var_list or ()))

    @property
    def written(self):
        return {op: name for step in self.steps for op, name in step.written.items()}

    @property
    def summarized(self):
        return any(step.summarized for step in self.steps)

    def state(self):
        return list(dict.fromkeys(v for step in self.steps for v in step.state()))

    def build(self, args, carry=None):
        """The step: every phase, in order (see the module)."""
        del carry  # (refused with phases)
        graph = tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations())
        outputs, ends, after, phase_outputs = {}, [], [], []
        for step, name in zip(self.steps, self.names):
            with tf.name_scope(name), tf.control_dependencies(after):
                out, end = step.build(args)
            phase_outputs.append(out)
            outputs[f"loss/{name}"] = out["loss"]
            ends.append(end)
            if self.order == "chained":
                after = [end]
        if self.order == "simultaneous":
            _apply_after_every_gradient(self.steps, self.names,
                                        graph.get_operations()[first_op:])
        outputs["loss"] = outputs[f"loss/{self.names[-1]}"]
        if self.summarized:
            with tf.control_dependencies(ends):
                outputs["summary"] = tf.compat.v1.summary.merge(
                    [out["summary"] for out in phase_outputs if "summary" in out], name="summaries")
        with tf.control_dependencies(ends):
            return outputs, tf.no_op(name="phases_done")


def _apply_after_every_gradient(steps, names, ops):
    """Order every write of each phase's apply (among ``ops``, this step's) after every
    other phase's loss and gradients (what their reads feed): the phases then all read
    the weights as the step found them. A variable two phases train is written by both
    applies, which nothing else orders: the later phase's writes of it wait for the
    earlier phase's, and a warning says so."""
    written = {}  # variable op -> the writes of the phases before, in phase order
    warned = set()
    for step, name in zip(steps, names):
        before = [t.op for other in steps if other is not step for t in other.before_apply]
        mine = [op for op in ops if op.name.startswith(step.apply_scope) and graph_lib.is_write(op)]
        for op in mine:
            variable = graph_lib.source_op(op.inputs[0])
            earlier = written.get(variable, [])
            if earlier and variable not in warned:
                warned.add(variable)
                warnings.warn(
                    f"phases='simultaneous': phase {name!r} and an earlier phase both train "
                    f"{variable.name!r}, and a single step that applies both after both "
                    f"gradients leaves the two applies unordered (a race). Here the later "
                    f"phase's apply of it runs after the earlier's, in phase order; give each "
                    f"phase its own var_list, or use phases='chained'.",
                    RuntimeWarning, stacklevel=graph_lib.user_stacklevel())
            wait = before + [o for o in earlier if o not in before]
            op._add_control_inputs([b for b in wait if b not in op.control_inputs])
        for op in mine:
            written.setdefault(graph_lib.source_op(op.inputs[0]), []).append(op)


def parse(loss_fn, optimizer, var_list, order):
    """The phases ``ms.unroll`` was given (a list of ``ms.phase``), checked; or None
    when ``loss_fn`` is one loss function."""
    if not isinstance(loss_fn, (list, tuple)):
        if order != "chained":
            raise ValueError(f"phases={order!r} needs a list of ms.phase(...) as loss_fn.")
        return None
    if not loss_fn or not all(isinstance(p, Phase) for p in loss_fn):
        raise TypeError("ms.unroll takes one loss function, or a list of ms.phase(loss_fn, "
                        "optimizer, var_list=...) (several phases per step).")
    if optimizer is not None or var_list is not None:
        raise TypeError("with phases, each ms.phase(...) takes its optimizer and var_list; "
                        "ms.unroll's optimizer and var_list stay unset.")
    if order not in ORDERS:
        raise ValueError(f"phases must be one of {ORDERS}, got {order!r}.")
    names = [p.name or f"phase_{i + 1}" for i, p in enumerate(loss_fn)]
    if len(set(names)) != len(names):
        raise ValueError(f"ms.phase names must differ, got {names}.")
    return list(loss_fn), names
