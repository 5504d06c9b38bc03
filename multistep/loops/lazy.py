"""The lazy value a deferred ``run`` returns for each fetched tensor.

A ``Lazy`` stands for what ``Session.run`` would have returned. Python that only carries
it along keeps it lazy: arithmetic (``avg_cost += c / total_batch``), numpy ufuncs and
array functions (``np.power(pred - rates, 2)``), indexing. Python that looks at it forces
it, which runs the pending steps first: ``float``/``int``/``bool``, comparisons,
formatting (f-strings, ``%``, ``str``, ``repr``), ``len``, iteration, ``np.asarray``,
any attribute (``.shape``, ``.item()``), item assignment and in-place operators (on the
array the loop's aliases share). ``ms.value(x)`` forces explicitly. A forced fetch is
exactly the object ``Session.run`` returns (an ``np.float32`` scalar, an ``ndarray``,
``bytes`` for a summary); pickling or copying a ``Lazy`` pickles or copies that object.

A fetched value answers ``isinstance`` as that object does (its ``__class__`` is the
type ``Session.run`` returns, known from the fetch's dtype and rank), without running
anything: ``isinstance(loss, np.floating)``, ``numbers.Number``, ``np.isscalar``, a JSON
encoder's checks. What Python cannot be told: ``type(x)`` is ``Lazy``, and a C function
that takes only ``bytes`` (``Summary.FromString``) refuses it (``ms.value(x)`` first).
"""

import operator
import types
import weakref

import numpy as np

__all__ = ["Lazy", "value"]

# The derived values (arithmetic on pending values) not yet computed, in creation order:
# computed as soon as their operands are, so that forcing one never recurses through a
# chain as long as the loop (``total += c`` over an epoch).
_WAITING = []
_NO_KWARGS = types.MappingProxyType({})
# numpy functions that write (a file, an array given): run now, not deferred.
_EFFECTFUL = frozenset({"save", "savez", "savez_compressed", "savetxt", "copyto", "put",
                        "put_along_axis", "place", "putmask", "fill_diagonal"})
# Effects of pending values (a summary written with a lazy value): held until done, run in
# the order they were asked for: (key, Lazy) pairs.
_EFFECTS = []


class Lazy:
    """A value of a deferred step (or computed from one) that is not known yet."""

    __slots__ = ("_fetch", "_fn", "_args", "_kwargs", "_lazies", "_value", "_error", "_done",
                 "_owner", "_type", "__weakref__")

    def __init__(self, fetch=None, fn=None, args=(), kwargs=None, type_=None):
        # fetch: (record, index) of a deferred step's fetch; fn/args: a derived value
        self._fetch, self._fn, self._args = fetch, fn, args
        self._kwargs = kwargs or _NO_KWARGS  # (one empty mapping for all: a dict is 64 bytes)
        self._value = self._error = None
        self._done = False
        self._type = type_  # the type Session.run returns for it, where known before it runs
        # _owner: the session whose steps it comes from (record.engine), for a feed's check
        if fetch is not None:
            self._lazies, self._owner = (), fetch[0].engine
        else:
            self._lazies = tuple(a for a in _flat(args, self._kwargs) if type(a) is Lazy)
            self._owner = next((a._owner for a in self._lazies), None)

    # -- forcing -----------------------------------------------------------------------

    def _resolved(self):
        """Whether the value is known. A derived value is computed by ``settle_waiting``
        once its operands are (after each run of pending steps), so it is known when it
        is done; its operands are not walked here (a chain as long as the loop)."""
        if not self._done and self._fetch is not None and self._fetch[0].done:
            self._settle(*self._fetch)
        return self._done

    def _settle(self, record, index):
        if record.error is not None:
            self._error = record.error
        else:
            self._value = record.values[index]
        self._done, self._fetch = True, None

    def _compute(self):
        try:
            args = [_force(a) for a in self._args]
            kwargs = {k: _force(v) for k, v in self._kwargs.items()}
            self._value = self._fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 (raised where the value is read)
            self._error = error
        self._done, self._fn, self._args, self._kwargs = True, None, (), _NO_KWARGS

    def _force(self):
        if not self._done:
            if self._fetch is not None:
                record, index = self._fetch
                if not record.done:
                    record.engine.force(record)  # runs the pending steps (settles it)
                if not self._done:
                    self._settle(record, index)
            else:
                for operand in self._lazies:  # the fetches it is computed from
                    operand._force()
                settle_waiting()
                if not self._done:
                    self._compute()
        if self._error is not None:
            raise self._error
        return self._value

    # -- what it is ----------------------------------------------------------------------

    @property
    def __class__(self):
        """The class of the value it stands for: ``isinstance(loss, np.floating)``,
        ``numbers.Number``, ``np.isscalar`` and a JSON encoder's checks see what they see
        as written. Known from the fetch's dtype and rank without running anything; a
        derived value's is known once computed (asking for it reads the value)."""
        if self._done and self._error is None:
            return type(self._value)
        if self._type is not None:
            return self._type
        return type(self._force())

    def __reduce_ex__(self, protocol):  # pickle and copy: the value itself (no multistep)
        return self._force().__reduce_ex__(protocol)

    # -- what forces -------------------------------------------------------------------

    def __float__(self):
        return float(self._force())

    def __int__(self):
        return int(self._force())

    def __index__(self):
        return operator.index(self._force())

    def __complex__(self):
        return complex(self._force())

    def __bool__(self):
        return bool(self._force())

    def __round__(self, *args):
        return round(self._force(), *args)

    def __format__(self, spec):
        return format(self._force(), spec)

    def __str__(self):
        return str(self._force())

    def __repr__(self):
        return repr(self._force())

    def __len__(self):
        return len(self._force())

    def __iter__(self):
        return iter(self._force())

    def __contains__(self, item):
        return item in self._force()

    def __hash__(self):
        return hash(self._force())

    def __eq__(self, other):
        return self._force() == _plain(other)

    def __ne__(self, other):
        return self._force() != _plain(other)

    def __lt__(self, other):
        return self._force() < _plain(other)

    def __le__(self, other):
        return self._force() <= _plain(other)

    def __gt__(self, other):
        return self._force() > _plain(other)

    def __ge__(self, other):
        return self._force() >= _plain(other)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._force(), dtype=dtype)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # (copy, pickle and numpy probe for protocols)
        return getattr(self._force(), name)

    def __setitem__(self, key, value):  # (an array's item: written where every alias sees it)
        self._force()[key] = _plain(value)

    # -- what stays lazy ---------------------------------------------------------------

    def __getitem__(self, key):
        return derive(operator.getitem, self, key)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or "out" in kwargs:
            inputs = [_force(x) for x in inputs]
            out = kwargs.get("out")
            if out is not None:  # written into the arrays the lazy values stand for
                kwargs["out"] = tuple(_force(o) for o in (out if isinstance(out, tuple)
                                                          else (out,)))
            result = getattr(ufunc, method)(*inputs, **kwargs)
            if out is not None:  # (numpy returns the out arrays: the loop's own objects)
                return out[0] if isinstance(out, tuple) and len(out) == 1 else out
            return result
        return derive(ufunc, *inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if func.__name__ in _EFFECTFUL:  # (it writes: now, as the loop as written does)
            return func(*_force(args), **_force(kwargs))
        return derive(func, *args, **kwargs)


def _binary(op):
    return (lambda self, other: derive(op, self, other),
            lambda self, other: derive(op, other, self))


for _name, _op in [("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv),
                   ("mod", operator.mod), ("pow", operator.pow), ("matmul", operator.matmul),
                   ("and", operator.and_), ("or", operator.or_), ("xor", operator.xor),
                   ("lshift", operator.lshift), ("rshift", operator.rshift),
                   ("divmod", divmod)]:
    _forward, _reflected = _binary(_op)
    setattr(Lazy, f"__{_name}__", _forward)
    setattr(Lazy, f"__r{_name}__", _reflected)
def _in_place(op, binary):
    def apply(self, other):
        if self._type is not np.ndarray and not (self._done and isinstance(self._value,
                                                                            np.ndarray)):
            return derive(binary, self, other)  # a scalar rebinds, as written: stays lazy
        value = self._force()  # an array: written in place, where every alias sees it
        op(value, _plain(other))
        return self
    return apply


for _name in ["add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
              "xor", "lshift", "rshift"]:
    _binary_op = getattr(operator, f"{_name}_" if _name in ("and", "or") else _name)
    setattr(Lazy, f"__i{_name}__", _in_place(getattr(operator, f"i{_name}"), _binary_op))
for _name, _op in [("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs),
                   ("invert", operator.invert)]:
    setattr(Lazy, f"__{_name}__", lambda self, _op=_op: derive(_op, self))


def derive(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the values the lazy arguments stand for: computed now
    if none is pending, else a ``Lazy`` computed when they are."""
    if not any(type(a) is Lazy and not a._resolved() for a in _flat(args, kwargs)):
        return fn(*[_force(a) for a in args], **{k: _force(v) for k, v in kwargs.items()})
    result = Lazy(fn=fn, args=args, kwargs=kwargs)
    _WAITING.append(weakref.ref(result))
    return result


def settle_waiting():
    """Computes, in creation order, each derived value whose operands are known, then
    each effect whose values are (called after each run of pending steps)."""
    waiting = []
    for ref in _WAITING:  # in creation order: a value's operands come before it
        lazy = ref()
        if lazy is None or lazy._done:
            continue
        if all(a._resolved() for a in lazy._lazies):
            lazy._compute()
        else:
            waiting.append(ref)
    _WAITING[:] = waiting
    while _EFFECTS:  # in order: a later one waits for an earlier one
        effect_lazy = _EFFECTS[0][1]
        if not all(a._resolved() for a in effect_lazy._lazies):
            break
        effect_lazy._compute()
        _EFFECTS.pop(0)


def effect(key, fn, *args):
    """Calls ``fn(*args)`` once the values of ``args`` are known, after the effects asked
    for before it (``key``: what ``run_effects`` finds them by, e.g. a summary writer)."""
    _EFFECTS.append((key, Lazy(fn=fn, args=args)))
    settle_waiting()


def run_effects(key):
    """Runs now (forcing what they need) the pending effects up to the last one of ``key``."""
    last = max((i for i, (k, _) in enumerate(_EFFECTS) if k is key), default=-1)
    for _, lazy in list(_EFFECTS[:last + 1]):
        try:
            lazy._force()
        except Exception:  # noqa: BLE001 (a failed step's summary: not written, as written)
            pass
    settle_waiting()


def value(x):
    """What a deferred ``run`` returned, forced: the pending steps run first if ``x`` (or
    a value in the nest ``x``: a list, tuple or dict) needs them. Anything else is
    returned as it is.

    Example:
      >>> import multistep as ms
      >>> ms.value([1.0, {"a": 2}])
      [1.0, {'a': 2}]
    """
    if type(x) is Lazy:
        return x._force()
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(value(v) for v in x)
    if isinstance(x, tuple):  # a namedtuple
        return type(x)(*[value(v) for v in x])
    if isinstance(x, dict):
        return type(x)((k, value(v)) for k, v in x.items())
    return x


def is_pending(x):
    """Whether ``x`` is a ``Lazy`` whose value is not known yet."""
    return type(x) is Lazy and not x._resolved()


def _flat(args, kwargs):
    out = []
    for a in list(args) + list(kwargs.values()):
        if type(a) is Lazy:  # (first: isinstance of another class would ask its __class__)
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += _flat(a, {})
        elif isinstance(a, dict):
            out += _flat((), a)
        else:
            out.append(a)
    return out


def _force(x):
    """``x`` with every ``Lazy`` in it (in lists, tuples, dicts) forced."""
    if type(x) is Lazy:
        return x._force()
    if isinstance(x, (list, tuple, dict)):
        return value(x)
    return x


def _plain(x):
    return x._force() if type(x) is Lazy else x

