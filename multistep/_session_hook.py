"""What multistep must know of every ``tf.compat.v1`` session, from before its first run:
how far each graph has been sent to a session (the shared random streams may rewire only
ops no session holds yet), and the streams' counters each session must initialise.

No TensorFlow here: ``import multistep`` installs this (``install``) at once if TensorFlow's
session module is loaded, else when it loads (an import hook), so that a session the
script makes after ``import multistep`` is seen from its first run, and ``multistep run``
need not import TensorFlow before the script does. Two methods of ``BaseSession`` are
wrapped: ``__init__`` (the session is marked born after the hook) and ``_extend_graph``,
which every run (and ``make_callable``) calls once before it runs: it records how far the
graph was sent, and where a graph shares its random streams (``multistep.compiler.
streams``) it first rewires the graph's new random ops and initialises the session's
counters.
"""

import importlib.abc
import importlib.util
import sys

__all__ = ["after_import", "born_after", "install", "raw_run", "sessions_before"]

_SESSION_MODULE = "tensorflow.python.client.session"
_STATE = {"extend": None, "init": None, "run": None, "late": False, "every": None,
          "before": None}
# on a graph: the largest op id a session may hold (op ids run one ahead of graph.version)
MARK = "_multistep_extended"
# on a graph: its multistep.compiler.streams.Streams
STREAMS = "_multistep_streams"


def _init(self, *args, **kwargs):
    self._multistep_born = True
    _STATE["init"](self, *args, **kwargs)


def _extend_graph(self):
    graph = self._graph
    streams = getattr(graph, STREAMS, None)
    if streams is None and _STATE["every"] is not None:  # (multistep run: every graph)
        streams = _STATE["every"](graph)
    if streams is not None:
        streams.before_run(self)
    _STATE["extend"](self)
    setattr(graph, MARK, graph.version + 1)


def born_after(session):
    """Whether ``session`` was made after the hook was installed (all its runs seen)."""
    return getattr(session, "_multistep_born", False)


def sessions_before():
    """The live sessions made before the hook was installed (they may have run unseen):
    found once (a walk of the garbage collector's objects), only where the hook was
    installed after TensorFlow's session module had loaded; none can be made later."""
    if not _STATE["late"]:
        return ()
    if _STATE["before"] is None:
        import gc
        import weakref

        base = sys.modules[_SESSION_MODULE].BaseSession
        _STATE["before"] = weakref.WeakSet(
            o for o in gc.get_objects() if isinstance(o, base) and not born_after(o))
    return list(_STATE["before"])


def raw_run(session, fetches):
    """TensorFlow's own ``BaseSession.run`` (no wrapper a deferral or recorder added)."""
    return _STATE["run"](session, fetches)


def every_graph(factory):
    """``multistep run``: ``factory(graph)`` gives each graph its streams at its first run."""
    _STATE["every"] = factory


def _patch(module):
    base = module.BaseSession
    if _STATE["extend"] is None:
        _STATE["extend"], _STATE["init"] = base._extend_graph, base.__init__  # noqa: SLF001
        _STATE["run"] = base.run
        base._extend_graph, base.__init__ = _extend_graph, _init  # noqa: SLF001


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls the functions ``after_import`` gave for a module once it has loaded whole, in
    the order they were given (then steps aside)."""

    def __init__(self, name):
        self.name, self.fns = name, []

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, fns = spec.loader.exec_module, self.fns

        def exec_then_call(module):
            exec_module(module)
            for fn in fns:
                fn()

        spec.loader.exec_module = exec_then_call
        return spec


def after_import(name, fn):
    """Calls ``fn()`` now if the module ``name`` is loaded, else once the program imports
    it (``multistep run``: the deferral is installed when the script imports TensorFlow,
    not before, so that nothing TensorFlow's import does happens earlier than as written)."""
    if name in sys.modules:
        fn()
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == name),
                  None)
    if finder is None:
        finder = _AfterImport(name)
        sys.meta_path.insert(0, finder)
    finder.fns.append(fn)


def install():
    """Installs the hook: now if TensorFlow's session module has loaded, else as it loads."""
    module = sys.modules.get(_SESSION_MODULE)
    if module is not None and hasattr(module, "BaseSession"):
        if _STATE["extend"] is None:
            _STATE["late"] = True
        _patch(module)
    elif not any(isinstance(f, _AfterImport) and f.name == _SESSION_MODULE
                 for f in sys.meta_path):
        after_import(_SESSION_MODULE, lambda: _patch(sys.modules[_SESSION_MODULE]))
