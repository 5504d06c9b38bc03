"""The loop's own frames and their source: what ``caught`` (the ``try`` around a run
call) and ``payback`` (the loops around it, and how many steps they have left) read.

A frame is the loop's unless its code is in Python's standard library (its frozen modules
too: ``runpy``) or an installed package (TensorFlow, numpy, multistep, a test runner's). A file's source is parsed once;
an expression is evaluated only where it is a name, an attribute of one, a constant, a
tuple or simple arithmetic of those: nothing is called.
"""

import ast
import linecache
import operator
import os
import sys
import sysconfig

__all__ = ["UNKNOWN", "evaluate", "loop_frames", "same_scope", "tree"]

_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PASSED_OVER = None  # (directories whose frames are not the loop's: set on first use)
_TREES = {}  # filename -> its parsed source, or None
UNKNOWN = object()
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
               ast.FloorDiv: operator.floordiv, ast.USub: operator.neg}


def loop_frames(depth=1):
    """The loop's frames that led to the caller's call, innermost first."""
    frame = sys._getframe(depth + 1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_passed_over() + ("<frozen ",)):
            yield frame
        frame = frame.f_back


def _passed_over():
    global _PASSED_OVER
    if _PASSED_OVER is None:
        import numpy as np
        import tensorflow as tf

        paths = sysconfig.get_paths()
        stdlib = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        dirs = [_OWN, os.path.dirname(os.path.abspath(tf.__file__)),
                os.path.dirname(os.path.abspath(np.__file__)), *stdlib]  # (_OWN: editable)
        _PASSED_OVER = tuple(d.rstrip(os.sep) + os.sep for d in dirs)
    return _PASSED_OVER


def tree(filename):
    """The parsed source of ``filename``, or None where it has none (``exec``'d code)."""
    if filename not in _TREES:
        try:
            _TREES[filename] = ast.parse("".join(linecache.getlines(filename)) or "\0")
        except (SyntaxError, ValueError):
            _TREES[filename] = None
    return _TREES[filename]


def same_scope(function, code):
    """Whether a statement in ``function`` (None: the module's level) is in ``code``."""
    if function is None:
        return code.co_name == "<module>"
    if isinstance(function, ast.Lambda):
        return code.co_name == "<lambda>" and code.co_firstlineno == function.lineno
    first = min([function.lineno] + [d.lineno for d in function.decorator_list])
    return code.co_name == function.name and code.co_firstlineno == first


def evaluate(node, frame):
    """A name, an attribute of one, a constant, a tuple, or ``+ - * //`` of those, in
    ``frame`` (nothing called), or UNKNOWN."""
    if isinstance(node, ast.Name):
        for scope in (frame.f_locals, frame.f_globals, frame.f_builtins):
            if node.id in scope:
                return scope[node.id]
        return UNKNOWN
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute):
        owner = evaluate(node.value, frame)
        try:
            return UNKNOWN if owner is UNKNOWN else getattr(owner, node.attr)
        except Exception:  # noqa: BLE001 (a lazy module's failed import, a property)
            return UNKNOWN
    if isinstance(node, ast.Tuple):
        return tuple(evaluate(element, frame) for element in node.elts)
    if isinstance(node, (ast.BinOp, ast.UnaryOp)) and type(node.op) in _ARITHMETIC:
        parts = ([node.left, node.right] if isinstance(node, ast.BinOp) else [node.operand])
        values = [evaluate(part, frame) for part in parts]
        if any(type(v) is not int for v in values):  # (ints only: no user type's operator)
            return UNKNOWN
        try:
            return _ARITHMETIC[type(node.op)](*values)
        except ArithmeticError:
            return UNKNOWN
    return UNKNOWN
