"""A user's training script as written, and under ``multistep run`` (every session it makes
deferred): run it, record what it did, compare, time.

``python -m multistep.tools.script [--steps N] [--xla] [--fuse F] [--record FILE] script.py
args...``
runs the script as ``python script.py args...`` would (its ``sys.argv``, ``__name__ ==
"__main__"``, its folder first on ``sys.path``, its exit code). With ``--record`` it
writes, at the end, every value each ``Session.run`` call returned (in call order) and
every global variable of each session as the session closed (or as the script ended):
what ``multistep verify script.py`` compares between the script as written and under
``multistep run``.
"""

import argparse
import os
import pickle
import re
import runpy
import sys
import time
import traceback

__all__ = ["compare", "main", "run_script"]


def run_script(path, args=(), *, steps=None, mode="while_loop", xla=False, record=None,
               report=False, fuse="when_it_pays"):
    """Runs ``path`` as a script; returns its exit code. ``steps``: defer every session
    it makes (``multistep run``). ``record``: write what it did to this file.

    Nothing is imported before the script's own imports (importing TensorFlow draws from
    numpy's global random state, sets up its logging): the deferral and the recorder
    are installed when the script imports TensorFlow."""
    if not os.path.isfile(path):
        print(f"multistep: no such script: {path}", file=sys.stderr)
        return 2
    from multistep import _session_hook

    recorder = []
    if steps is not None:
        _session_hook.after_import("tensorflow", lambda: _defer_every_session(steps, mode, xla,
                                                                                 fuse))
    if record:
        _session_hook.after_import("tensorflow", lambda: recorder.append(_Recorder()))
    sys.argv = [path] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    code, start = 0, time.perf_counter()
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException as error:  # noqa: BLE001 (the script's error, as Python reports it)
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next  # (runpy's frames and this function's are not the script's)
        traceback.print_exception(type(error), error, tb or error.__traceback__)
        code = 1
    finally:  # the steps the script deferred before it ended (or raised) run now
        deferred = sys.modules.get("multistep.loops.deferred")
        try:
            if deferred is not None:
                deferred.flush_all("the script's end")
        except Exception:  # noqa: BLE001 (a deferred step failed: its error, exit 1)
            traceback.print_exc()
            code = code or 1
    elapsed = time.perf_counter() - start
    if record:
        _Recorder.write(recorder[0] if recorder else None, record, code, elapsed)
    deferred = sys.modules.get("multistep.loops.deferred")
    if steps is not None and report and deferred is not None:
        for r in deferred.reports():
            print(r, file=sys.stderr)
    return code


def _defer_every_session(steps, mode, xla, fuse):
    from multistep.loops import deferred

    deferred.defer_every_session(steps, mode=mode, xla=xla, fuse=fuse)


class _Recorder:
    """Records each ``Session.run`` call's values and each session's variables at close."""

    def __init__(self):
        from tensorflow.python.client import session as session_lib

        from multistep.loops import deferred

        deferred._install()  # noqa: SLF001 (a script's own ms.deferred patches run: first)
        # the sessions in the order they first ran, held: a session the script drops
        # unclosed is read at its end, not whenever the garbage collector finalizes it (a
        # read then is at no fixed point of either run, and may find its weak references
        # already cleared)
        self.runs, self.sites, self.closes, self.sessions = [], [], [], {}
        self.first = None
        run, close = session_lib.BaseSession.run, session_lib.BaseSession.close
        recorder, self.run = self, run  # (the run it wraps: its own reads are not recorded)

        def recorded_run(sess, fetches, feed_dict=None, options=None, run_metadata=None):
            engine = deferred._ENGINES.get(sess)  # noqa: SLF001
            inside = engine is not None and getattr(engine.local, "depth", 0)
            result = run(sess, fetches, feed_dict, options, run_metadata)
            if not inside:
                if recorder.first is None:
                    recorder.first = time.perf_counter()
                recorder.sessions.setdefault(id(sess), sess)
                recorder.runs.append(result)
                recorder.sites.append(deferred._site())  # noqa: SLF001
            return result

        def recorded_close(sess):
            if not getattr(sess, "_closed", True) and id(sess) in recorder.sessions:
                engine = deferred._ENGINES.get(sess)  # noqa: SLF001
                if engine is not None and not engine.closed:
                    engine.flush("close")  # (TensorFlow may close from a thread of its own)
                recorder.closes.append(recorder.variables(sess))
            return close(sess)

        session_lib.BaseSession.run = recorded_run
        session_lib.BaseSession.close = recorded_close

    def variables(self, sess):
        """Every global variable of ``sess``'s graph (a read not recorded as a run)."""
        import tensorflow as tf

        with sess.graph.as_default():
            variables = tf.compat.v1.global_variables()
        return self.run(sess, {v.op.name: v for v in variables}) if variables else {}

    @staticmethod
    def write(recorder, path, code, elapsed):
        """Writes the record (``recorder`` None: the script never imported TensorFlow)."""
        if recorder is None:
            with open(path, "wb") as f:
                pickle.dump({"runs": [], "sites": [], "unshared": {}, "closes": [],
                             "exit": code, "seconds": elapsed, "from_first_run": 0.0}, f)
            return
        recorder.finish(path, code, elapsed)

    def finish(self, path, code, elapsed):
        import multistep as ms
        from multistep.loops import deferred

        for sess in list(self.sessions.values()):
            if not getattr(sess, "_closed", True):
                self.closes.append(self.variables(sess))
        try:  # each run's values as a flat list (a MonitoredSession keys its by hook)
            runs = [deferred.flatten_fetches(ms.value(r)) for r in self.runs]
        except Exception as error:  # noqa: BLE001 (a value of a step that failed)
            runs = [repr(error)]
        streams = sys.modules.get("multistep.compiler.streams")
        unshared = dict(streams.COPIED_UNSHARED) if streams is not None else {}
        with open(path, "wb") as f:
            reports = deferred.reports()
            pickle.dump({"runs": runs, "sites": self.sites, "unshared": unshared,
                         "closes": [ms.value(c) for c in self.closes],
                         "steps": sum(r.steps for r in reports),
                         "build_seconds": sum(r.build_seconds for r in reports),
                         "exit": code, "seconds": elapsed,
                         "from_first_run": time.perf_counter() - (self.first or 0)}, f)


# tempfile's names (mkdtemp, mkstemp): a run's value naming one differs between runs
_TEMP_NAME = re.compile(rb"tmp[a-z0-9_]{8}")


def compare(a, b):
    """The first difference between two records (``run_script(record=...)``), as a
    sentence, or None if they are bitwise the same."""
    import numpy as np

    from multistep._compare import same_bits
    from multistep.loops import deferred

    def same(x, y):
        if isinstance(x, bytes) and isinstance(y, bytes):  # (a path under mkdtemp())
            return _TEMP_NAME.sub(b"tmp", x) == _TEMP_NAME.sub(b"tmp", y)
        if isinstance(x, (np.ndarray, np.generic)) or isinstance(y, (np.ndarray, np.generic)):
            return same_bits(x, y)
        return type(x) is type(y) and x == y

    if a["exit"] != b["exit"]:
        return f"exit codes differ: {a['exit']} and {b['exit']}"
    if len(a["runs"]) != len(b["runs"]):
        return f"the scripts made {len(a['runs'])} and {len(b['runs'])} Session.run calls"
    for i, (x, y) in enumerate(zip(a["runs"], b["runs"])):
        lx, ly = deferred.flatten_fetches(x), deferred.flatten_fetches(y)
        if len(lx) != len(ly) or not all(same(p, q) for p, q in zip(lx, ly)):
            return f"the values of Session.run call {i + 1} (at {a['sites'][i]}) differ"
    if len(a["closes"]) != len(b["closes"]):
        return f"{len(a['closes'])} and {len(b['closes'])} sessions closed"
    for i, (x, y) in enumerate(zip(a["closes"], b["closes"])):
        for name in sorted(set(x) | set(y)):
            if name not in x or name not in y or not same(x[name], y[name]):
                return f"variable {name!r} differs at session close {i + 1}"
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m multistep.tools.script")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--mode", default="while_loop")
    parser.add_argument("--xla", action="store_true")
    parser.add_argument("--fuse", default="when_it_pays")
    parser.add_argument("--record")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    return run_script(args.script, args.args, steps=args.steps, mode=args.mode, xla=args.xla,
                      fuse=args.fuse, record=args.record, report=args.report)


if __name__ == "__main__":
    sys.exit(main())
