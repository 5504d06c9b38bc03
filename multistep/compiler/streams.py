"""One random stream per random op, however many programs copy it.

A stateful random op (dropout's ``RandomUniform``, a GAN's ``RandomStandardNormal``) draws
from a Philox generator private to its kernel: keyed by its ``seed``, its counter starting
at ``[0, seed2]`` and skipping a fixed amount a call. Each compiled copy of the op is a
kernel of its own, so a copy restarts the stream, and an evaluation through the original
op no longer follows the compiled steps. A draw is a function of the seeds and of how far
the counter has moved, so a stateless op on the same key and counter draws the same bits.

``share(graph)`` rewires each such op that no session holds yet: its consumers read a
stateless op with the same seeds whose key and counter come from a counter of the
session's (a resource variable outside every collection, read and advanced atomically by
``RngReadAndSkip`` by exactly what the kernel skips). The original op stays in the graph,
unused, its name unchanged; every copy of the new ops (each program, each fetch set, each
mode) reads and advances the one counter, so all of them, and the original's consumers,
draw the one stream the program as written draws. Savers, initializers and
``global_variables()`` do not see the counters: each session initialises its own before
its first run that needs them (``multistep._session_hook``), as each session's kernel
starts its own stream.

Kept on their own kernels (``Streams.kept`` says why): ops no stateless op continues
(``Multinomial``, ``RandomPoisson``, ``ParameterizedTruncatedNormal``: their stateless
twins take only a seed, which they hash into a key and counter), unseeded ops (their
kernel picks a random seed: the program as written is not repeatable either), ops inside
functions (a ``tf.function``, a v2 ``tf.cond``), and ops a session has already run.
"""

import contextlib
import threading
import weakref

import numpy as np
import tensorflow as tf

from multistep import _session_hook
from multistep import graph as graph_lib

__all__ = ["REPRODUCED", "Streams", "kept", "share", "replaced", "streams_of", "unshared"]

_PHILOX = 1  # RNG_ALG_PHILOX: the stateful kernels' generator
# Each random op a compiled program copied with a stream of its own, in this process
# ({'name' (Type): why}): what multistep verify names as a likely cause of a difference.
COPIED_UNSHARED = {}
_raw = tf.raw_ops


def _elements(op, shape):
    """The number of elements a draw of ``shape`` (an input of ``op``) makes, as uint64."""
    static = tf.get_static_value(shape)
    if static is not None:
        return tf.constant(int(np.prod(static)), tf.uint64)
    return tf.cast(tf.reduce_prod(shape), tf.uint64)


def _shuffled_rows(op):
    """``RandomShuffle`` of n rows draws n - 1 32-bit numbers (Fisher-Yates), so it
    reserves ceil((n - 1) / 4) counters a call (none for one row or none), found draw by
    draw against StatelessShuffle; in units of 256: this op's counter is kept scaled."""
    rows = op.inputs[0].shape[0] if op.inputs[0].shape.rank else None
    if isinstance(rows, int):
        return tf.constant((rows + 2) // 4, tf.uint64)
    rows = tf.shape(op.inputs[0], out_type=tf.int64)[0]
    return tf.cast((rows + 2) // 4, tf.uint64)


def _gamma_elements(op):
    shape, alpha = op.inputs
    static = tf.get_static_value(shape)
    if static is not None and alpha.shape.is_fully_defined():
        return tf.constant(int(np.prod(static)) * alpha.shape.num_elements(), tf.uint64)
    return tf.cast(tf.reduce_prod(shape), tf.uint64) * tf.cast(tf.size(alpha), tf.uint64)


def _gamma(op, key, counter):
    shape, alpha = op.inputs
    full = tf.concat([shape, tf.shape(alpha, out_type=shape.dtype)], 0)
    return _raw.StatelessRandomGammaV3(shape=full, key=key, counter=counter, alg=_PHILOX,
                                       alpha=alpha)


# op type -> (the stateless draw of op at key and counter, the draw's skip, scaled):
# scaled: the counter is kept in units of 1/256 (the op skips fewer than 256 a call)
REPRODUCED = {
    "RandomUniform": (lambda op, k, c: _raw.StatelessRandomUniformV2(
        shape=op.inputs[0], key=k, counter=c, alg=_PHILOX, dtype=op.get_attr("dtype")),
        lambda op: _elements(op, op.inputs[0]), False),
    "RandomStandardNormal": (lambda op, k, c: _raw.StatelessRandomNormalV2(
        shape=op.inputs[0], key=k, counter=c, alg=_PHILOX, dtype=op.get_attr("dtype")),
        lambda op: _elements(op, op.inputs[0]), False),
    "TruncatedNormal": (lambda op, k, c: _raw.StatelessTruncatedNormalV2(
        shape=op.inputs[0], key=k, counter=c, alg=_PHILOX, dtype=op.get_attr("dtype")),
        lambda op: _elements(op, op.inputs[0]), False),
    "RandomUniformInt": (lambda op, k, c: _raw.StatelessRandomUniformIntV2(
        shape=op.inputs[0], key=k, counter=c, alg=_PHILOX, minval=op.inputs[1],
        maxval=op.inputs[2]), lambda op: _elements(op, op.inputs[0]), False),
    "RandomShuffle": (lambda op, k, c: _raw.StatelessShuffle(
        value=op.inputs[0], key=k, counter=c, alg=_PHILOX), _shuffled_rows, True),
    "RandomGamma": (_gamma, _gamma_elements, False),
}
_NOT_CONTINUED = ("no stateless op continues its stream (the stateless twin takes only a "
                  "seed, hashed into a key and counter)")


class Streams:
    """The shared streams of one graph: which ops draw from a counter, the counters'
    initialisers, and which sessions have run them."""

    def __init__(self, graph):
        self._graph = weakref.ref(graph)
        self.lock = threading.RLock()
        self.scanned = 0  # ops of id <= scanned have been looked at
        self.initializers = []  # one a counter, in the order made
        self.ready = weakref.WeakKeyDictionary()  # session -> counters it initialised
        self.replaced = {}  # the original op's output (ref) -> the shared stream's draw
        self.kept = {}  # op name -> why it keeps its own kernel
        self.held = _held_elsewhere(graph)  # op ids a session seen too late may hold

    @property
    def graph(self):
        return self._graph()

    def before_run(self, session):
        """Before ``session`` sends the graph and runs: new random ops rewired, the
        session's counters initialised."""
        graph = self.graph
        with self.lock:
            if graph.version + 1 > self.scanned:
                self.share()
            done = self.ready.get(session, 0)
            if done < len(self.initializers):
                self.ready[session] = len(self.initializers)  # (the run below comes back here)
                _session_hook.raw_run(session, self.initializers[done:])

    def share(self):
        """Rewires the random ops made since the last look that no session holds."""
        graph = self.graph
        with self.lock, _unfinalized(graph):
            held = max(getattr(graph, _session_hook.MARK, 0), self.held)
            last = graph.version + 1
            by_id = graph._nodes_by_id  # noqa: SLF001
            new = [by_id[i] for i in range(self.scanned + 1, last + 1) if i in by_id]
            self.scanned = last
            for op in new:
                for i, tensor in enumerate(op.inputs):  # a later consumer of a rewired op
                    draw = self.replaced.get(tensor.ref())
                    if draw is not None and op._id > held:  # noqa: SLF001
                        op._update_input(i, draw)  # noqa: SLF001
                if graph_lib.is_stateful_random(op):
                    self._rewire(op, held)
            self.scanned = graph.version + 1  # (the ops made here: none draws)

    def _rewire(self, op, held):
        kind = REPRODUCED.get(op.type)
        seed, seed2 = op.get_attr("seed"), op.get_attr("seed2")
        consumers = list(op.outputs[0].consumers()) + list(op._control_outputs)  # noqa: SLF001
        if kind is None:
            self.kept[op.name] = _NOT_CONTINUED
        elif seed == 0 and seed2 == 0:
            self.kept[op.name] = ("unseeded: its kernel draws from a random seed (the program "
                                  "as written differs from run to run too)")
        elif any(c._id <= held for c in consumers):  # noqa: SLF001
            self.kept[op.name] = "a session had run it before multistep saw the graph"
        else:
            draw, initializer = _stream(op, kind, seed, seed2)
            for consumer in op.outputs[0].consumers():
                for i, tensor in enumerate(consumer.inputs):
                    if tensor is op.outputs[0]:
                        consumer._update_input(i, draw)  # noqa: SLF001
            for consumer in op._control_outputs:  # noqa: SLF001
                consumer._add_control_input(draw.op)  # noqa: SLF001
            self.replaced[op.outputs[0].ref()] = draw
            self.initializers.append(initializer)


def _stream(op, kind, seed, seed2):
    """The ops of one shared stream: (its draw, its counter's initialiser)."""
    build, skip, scaled = kind
    graph = op.graph
    with _outside(graph):  # (unique_name prefixes the caller's name scope: none here)
        scope = graph.unique_name(f"{op.name}_stream", mark_as_used=True)
    with _outside(graph), graph.name_scope(scope + "/"), graph.device(op.device or None):
        counter = _raw.VarHandleOp(dtype=tf.int64, shape=[3], shared_name=f"{scope}/counter",
                                   name="counter")
        start = tf.constant(np.array([0, seed2, seed], np.int64), name="start")
        initializer = _raw.AssignVariableOp(resource=counter, value=start, name="initialize")
        context = op._get_control_flow_context()  # noqa: SLF001 (a v1 cond's, a v1 loop's)
        graph._set_control_flow_context(context)  # noqa: SLF001
        try:
            state = _raw.RngReadAndSkip(resource=counter, alg=tf.constant(_PHILOX),
                                        delta=skip(op), name="read_and_skip")
            bits = tf.bitcast(state, tf.uint64)
            position = bits[:2]
            if scaled:
                position = tf.stack([tf.bitwise.right_shift(bits[0], tf.constant(8, tf.uint64)),
                                     bits[1]])
            draw = build(op, bits[2:], position)
        finally:
            graph._set_control_flow_context(None)  # noqa: SLF001
    return draw, initializer


@contextlib.contextmanager
def _outside(graph):
    """Builds in ``graph`` with none of the scopes the caller may be in: no control
    dependencies, no control flow context, no colocation, no name scope."""
    context = graph._get_control_flow_context()  # noqa: SLF001
    graph._set_control_flow_context(None)  # noqa: SLF001
    try:
        with graph.as_default(), graph.control_dependencies(None), \
                graph.colocate_with(None, ignore_existing=True), graph.name_scope(None):
            yield
    finally:
        graph._set_control_flow_context(context)  # noqa: SLF001


@contextlib.contextmanager
def _unfinalized(graph):
    finalized = graph.finalized
    if finalized:
        graph._unsafe_unfinalize()  # noqa: SLF001 (a MonitoredSession finalizes its graph)
    try:
        yield
    finally:
        if finalized:
            graph.finalize()


def _held_elsewhere(graph):
    """The largest op id a live session that the hook has not seen from its birth may
    hold (0 if none): only where multistep was imported after such a session was made."""
    for session in _session_hook.sessions_before():
        if getattr(session, "_graph", None) is graph and not getattr(session, "_closed", True):
            return graph.version + 1
    return 0


def streams_of(graph):
    """The graph's ``Streams`` (made, and its ops shared, on first call)."""
    streams = getattr(graph, _session_hook.STREAMS, None)
    if streams is None:
        _session_hook.install()
        streams = Streams(graph)
        setattr(graph, _session_hook.STREAMS, streams)
    return streams


def share(graph):
    """Shares the streams of ``graph``'s random ops that no session holds; returns the
    graph's ``Streams``."""
    streams = streams_of(graph)
    streams.share()
    return streams


def unshared(graph, found):
    """A short sentence naming the random ops ``found`` (``graph_lib.stateful_random_ops``
    strings) whose stream is not shared, and why (the first op's reason)."""
    reasons = kept(graph)
    name = found[0].split("'")[1] if found[0].count("'") >= 2 else ""
    why = reasons.get(name, "inside a function (a tf.function, a v2 tf.cond or loop), "
                            "which the streams do not rewire")
    for item in found:
        COPIED_UNSHARED.setdefault(item, reasons.get(item.split("'")[1] if "'" in item else "",
                                                     why))
    what = f"{found[0]}" + (f" and {len(found) - 1} more random ops" if len(found) > 1 else "")
    return f"{what} draw{'' if len(found) > 1 else 's'} from a kernel's own stream ({why})"


def replaced(graph):
    """{the output of a rewired random op (``.ref()``): its shared stream's draw}."""
    streams = getattr(graph, _session_hook.STREAMS, None)
    return streams.replaced if streams is not None else {}


def kept(graph):
    """{op name: why it keeps its own kernel} for ``graph`` (empty if never shared)."""
    streams = getattr(graph, _session_hook.STREAMS, None)
    return dict(streams.kept) if streams is not None else {}
