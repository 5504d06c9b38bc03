"""The compiler, ``ms.compile``: the user's single step copied N times (or into one loop
body), state shared, and the program around it.

``placement`` is the one shared-versus-copied rule; ``copy`` makes the copies; ``feeds``
turns placeholders into per-step inputs; ``runs`` runs a compiled program and reports the
steps a failing run applied; ``every`` and ``tripwires`` are the program around the step;
``kernels`` reads the kernels a run executed; ``xla`` says whether a step compiles under
XLA. Imports only ``multistep.graph`` below it.
"""
