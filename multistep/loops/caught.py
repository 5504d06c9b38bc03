"""Whether the loop's own Python catches an error a run raises: the ``try`` around the run
call, found in the source of the calling frames.

A deferred step's error is raised at the run that runs it, later than the call that made
the step. Where the loop catches that error (``while True: try: sess.run(train) except
tf.errors.OutOfRangeError: break``), the loop as written stops at the failing step; a
deferred loop would have gone past it. ``catching(errors)`` names the ``try`` that would
catch one of ``errors`` raised at the current run call, or returns None.

Where the frame's code has no source (``exec`` of a string), its bytecode's exception
table tells instead: any ``except`` clause the error reaches is taken to match.

A ``try`` catches when one of its ``except`` clauses matches (a bare ``except``, or a type
that the error is an instance of, its expression evaluated in the frame; an expression
that cannot be evaluated is taken to match) and that clause does not end in a bare
``raise``. A ``finally`` and a ``with`` are not catches: the error goes on (a
``MonitoredSession``'s ``__exit__`` swallows the input's end: the deferred session knows
that one). Frames of Python's standard library and of installed packages (TensorFlow,
numpy, multistep, a test runner's) are not the loop's and are passed over.
"""

import ast
import dis
import os

from multistep.loops import frames

__all__ = ["catching"]

_TRIES = {}  # filename -> [(try node, the function node it is in or None)]


def catching(errors):
    """``file:line`` of the innermost ``try`` of the loop's frames that would catch one of
    ``errors`` (exception classes) raised here, or None."""
    for frame in frames.loop_frames():
        found = _catching_in(frame, errors)
        if found is not None:
            return found
    return None


def _catching_in(frame, errors):
    tries = _tries(frame.f_code.co_filename)
    if tries is None:  # (no source: exec'd code) its bytecode's handlers
        return _catching_in_bytecode(frame)
    line = frame.f_lineno
    for node, function in tries:
        body_start, body_end = node.body[0].lineno, node.body[-1].end_lineno
        if not body_start <= line <= body_end or not frames.same_scope(function, frame.f_code):
            continue
        for handler in node.handlers:
            if _reraises(handler):
                continue
            if handler.type is None or _matches(handler.type, frame, errors):
                return f"{os.path.basename(frame.f_code.co_filename)}:{node.lineno}"
    return None


def _tries(filename):
    """Each ``try`` of ``filename`` that has ``except`` clauses, innermost first (by
    line), with the function it is written in (None: the module's level); None where
    ``filename`` has no Python source."""
    if filename not in _TRIES:
        found, tree = [], frames.tree(filename)
        if tree is None:
            _TRIES[filename] = None
            return None

        def visit(node, function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    visit(child, child)
                    continue
                if isinstance(child, (ast.Try, getattr(ast, "TryStar", ast.Try))) \
                        and child.handlers:
                    found.append((child, function))
                visit(child, function)

        visit(tree, None)
        found.sort(key=lambda pair: -pair[0].lineno)
        _TRIES[filename] = found
    return _TRIES[filename]


def _catching_in_bytecode(frame):
    """``file:line`` of the handler that an error raised at ``frame``'s current instruction
    reaches first, past ``with`` and ``finally`` handlers (Python 3.11's exception table),
    or None. An ``except`` clause's type is not read here: it is taken to match."""
    parse = getattr(dis, "_parse_exception_table", None)
    if parse is None:
        return None
    code, offset = frame.f_code, frame.f_lasti
    entries = list(parse(code))
    instructions = {i.offset: i for i in dis.get_instructions(code)}
    for _ in range(len(entries)):
        entry = next((e for e in entries if e.start <= offset < e.end), None)
        if entry is None:
            return None
        after = [instructions[o] for o in sorted(instructions) if o >= entry.target][:12]
        names = [i.opname for i in after]
        if names[:1] == ["PUSH_EXC_INFO"] and "WITH_EXCEPT_START" not in names[:2] and (
                names[1:2] == ["POP_TOP"] or "CHECK_EXC_MATCH" in names):
            line = next((i.positions.lineno for i in after if i.positions.lineno), "?")
            return f"{os.path.basename(code.co_filename)}:{line}"
        offset = entry.target  # (a with's exit, a finally, a clean-up: the error goes on)
    return None


def _reraises(handler):
    last = handler.body[-1]
    return isinstance(last, ast.Raise) and last.exc is None


def _matches(expression, frame, errors):
    """Whether the ``except`` clause's type matches one of ``errors`` (an expression not
    evaluated here is taken to match)."""
    caught = frames.evaluate(expression, frame)
    if caught is frames.UNKNOWN:
        return True
    caught = caught if isinstance(caught, tuple) else (caught,)
    return any(c is frames.UNKNOWN or isinstance(c, type) and issubclass(e, c)
               for c in caught for e in errors)
