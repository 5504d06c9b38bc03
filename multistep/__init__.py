"""multistep: N real descent steps in one ``sess.run``, identical to N single steps.

The public names load on first use (PEP 562), so ``import multistep`` and the
command line's ``--help`` do not import TensorFlow; ``ms.unroll`` and the rest
import it when first touched.
"""

import importlib
import sys
import types

# Public name -> the submodule that defines it (a submodule itself maps to None).
_NAMES = {
    "GraphTooLargeError": "builder.unroll", "InputExhaustedError": "builder.unroll",
    "Unrolled": "builder.unroll", "unroll": "builder.unroll", "phase": "builder.phases",
    "Compiled": "compiler.compile", "compile": "compiler.compile",
    "StepFailedError": "compiler.compile", "every": "compiler.every",
    "deferred": "loops.deferred", "value": "loops.lazy",
    "Report": "verify", "session_config": "verify", "verify": "verify",
    "RuleOptimizer": "builder.rules",
    "StaleForwardError": "builder.lint",
    "add_noise": "builder.transforms", "chain": "builder.transforms",
    "clip_by_global_norm": "builder.transforms", "clip_by_norm": "builder.transforms",
    "clip_by_value": "builder.transforms", "dedupe_sparse": "builder.transforms",
    "scale": "builder.transforms",
    # public submodules, by where they live
    "distribute": "loops.distribute", "hooks": "loops.hooks", "kernels": "compiler.kernels",
    "keras": "tf2.keras", "rules": "builder.rules", "sampling": "builder.sampling",
    "summaries": "builder.summaries", "tf2": "tf2",
}
# The public names that are submodules (ms.hooks, ...): the rest are functions and classes.
_MODULES = frozenset({"distribute", "hooks", "kernels", "keras", "rules", "sampling",
                      "summaries", "tf2"})
__all__ = sorted(_NAMES)
__version__ = "0.2.0"


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module 'multistep' has no attribute {name!r}")
    module = importlib.import_module(f"multistep.{_NAMES[name]}")
    value = module if name in _MODULES else getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_NAMES))


class _Package(types.ModuleType):
    """The import system binds each submodule as an attribute of its package once it has
    loaded; where a public function shares its submodule's name (``unroll``, ``verify``),
    the function keeps the name, as ``from multistep.builder.unroll import unroll`` left it."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and name in _NAMES and name not in _MODULES:
            value = globals()["__getattr__"](name)  # the function (ms.verify), not its module
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

# Every tf.compat.v1 session made from now on is seen from its first run (no TensorFlow
# import here: the hook waits for TensorFlow's session module if it has not loaded).
from multistep import _session_hook  # noqa: E402

_session_hook.install()
