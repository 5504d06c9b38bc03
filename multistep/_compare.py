"""The bitwise comparison both verifiers use (``ms.verify`` for TF1 programs,
``ms.tf2.verify`` for TF2 steps), and the report they return."""

import dataclasses

import numpy as np

__all__ = ["Report", "max_abs_diff", "same_bits"]


@dataclasses.dataclass(frozen=True)
class Report:
    """The result of ``verify``.

    Attributes:
      steps, runs, atol: what was compared: ``runs`` fused runs of ``steps``
        inner steps against ``steps * runs`` single steps.
      per_variable: name -> max |fused - single| over all runs; the key
        ``"losses"`` holds the per-step losses.
      first_divergence: ``(run, name)`` of the first comparison over ``atol``
        (run counts from 1), or None.
      bitwise: every compared array was bit-for-bit identical.
      fused_losses, single_losses: float32 ``[steps * runs]``, each inner step's loss.
      final_values: name -> value of every variable in the fused graph at the end.
      kernels: the first difference between the kernels an inner step executed and
        those a single step executed (``multistep.compiler.kernels.Difference``: names the step
        and the kernels on each side), or None when they are the same; read from the
        partition graphs of the first run of each. ``same_kernels`` is True, False, or
        None where no step's kernels could be read (all N steps in one XLA program).
      explain: the summary reports the kernels even when the values agree.
      xla: the comparison was of compiled programs (``verify(..., xla=True)``): fused
        XLA against the single-step XLA program.
      plain_max_abs_diff: with ``xla``, the max |Δ| between the fused XLA program and
        plain (uncompiled) single steps, over the same variables and losses; information,
        not a verdict. Else None.
      random_ops: the stateful random ops of the fused build's steps (``'name' (Type)``),
        which draw otherwise fused than single; a divergence names them as its suspect.
      as_written: the reference was the program as written (``build_fn`` returned an
        ``ms.compile`` program): its original fetches, run ``steps * runs`` times by
        plain ``sess.run`` in a session of their own. What no comparison sees is said in
        the summary: Python your loop runs between calls, and ops it runs outside the
        fetches (a hook's, an evaluation's).
      data_order: why the two builds may read their data in different orders (their
        ``tf.data`` pipeline draws at random without a seed, or with seeds that differ
        between them), or None. A divergence is then no verdict on the training code;
        the summary says so, and how to seed the pipeline.
      every: the ``ms.every`` conds the compared step holds (their names): the
        reference runs them too, so the comparison cannot tell whether they stand where
        the loop's Python ``if`` ran its ops; the summary says so.
    """

    steps: int
    runs: int
    atol: float
    per_variable: dict
    first_divergence: tuple
    bitwise: bool
    fused_losses: np.ndarray
    single_losses: np.ndarray
    final_values: dict
    kernels: object = None
    same_kernels: object = None
    explain: bool = False
    xla: bool = False
    plain_max_abs_diff: object = None
    data_order: object = None
    random_ops: tuple = ()
    as_written: bool = False
    every: tuple = ()

    @property
    def ok(self):
        return self.first_divergence is None

    @property
    def max_abs_diff(self):
        return max(self.per_variable.values())

    def summary(self):
        """One line: the verdict and the max |Δ|."""
        verdict = "OK" if self.ok else "DIVERGED"
        exact = " (bitwise equal)" if self.bitwise else ""
        what = ("XLA runs vs the single-step XLA program" if self.xla
                else "compiled runs vs the program as written" if self.as_written
                else "runs vs single steps")
        line = (f"verify: {self.steps}-step {what}, {self.runs} runs, "
                f"{len(self.per_variable) - 1} variables and the losses compared after "
                f"each run: max |Δ| = {self.max_abs_diff:.3g}{exact}, atol = {self.atol:g}: {verdict}")
        if not self.ok:
            run, name = self.first_divergence
            first = (run - 1) * self.steps + 1
            line += (f"; first divergence in run {run} (global steps {first}-"
                     f"{first + self.steps - 1}) at {name!r}")
            if self.data_order is not None:
                line += "\n" + self.data_order
            if self.random_ops:
                line += (f"\nsuspect: the steps draw with stateful random ops "
                         f"({', '.join(self.random_ops[:3])}{', ...' if len(self.random_ops) > 3 else ''}), "
                         f"whose draws depend on how many sess.run calls were made: fused "
                         f"and single steps draw different numbers. Draw statelessly, keyed on "
                         f"the global step (ms.unroll's build-time warning says how)")
        if self.plain_max_abs_diff is not None:
            line += (f"\nagainst plain single steps (no XLA): max |Δ| = "
                     f"{self.plain_max_abs_diff:.3g}, information only: XLA fuses and orders "
                     f"the arithmetic its own way, so its programs round otherwise than "
                     f"TensorFlow's kernels")
        if self.explain or not self.ok or self.same_kernels is False:
            line += "\n" + self._kernel_line()
        if self.as_written:
            line += ("\nnot seen: what your loop does between sess.run calls (Python every K "
                     "steps, a learning-rate change) and ops it runs outside the fetches (a "
                     "hook's fetch of the original loss, an evaluation run): each runs once a "
                     "call of the compiled program, not once a step")
            if self.random_ops and self.ok:
                line += (f"\nrandom draws: the steps draw from stateful random ops "
                         f"({', '.join(self.random_ops[:3])}"
                         f"{', ...' if len(self.random_ops) > 3 else ''}), equal here where only "
                         f"the steps run. A run of the original ops that draws (an "
                         f"evaluation with dropout on, a VAE's sample) moves their stream, "
                         f"and the compiled steps then differ from your loop's; "
                         f"OriginalOpRanWarning says so at the next compiled run. Draw "
                         f"statelessly (keyed on the global step), or evaluate with "
                         f"training=False")
        if self.every:
            line += (f"\nms.every ops in the step ({', '.join(self.every)}) run in the "
                     f"reference too: they are compared with themselves, not with your "
                     f"loop's Python if (check that after= or before= matches where your "
                     f"loop ran the ops: after the train run, or above it)")
        return line

    def _kernel_line(self):
        if self.same_kernels is None:
            return ("kernels: not compared (no inner step's kernels in the partition graphs: "
                    "the steps ran inside one XLA program, or were not built by ms.unroll or "
                    "ms.compile)")
        if self.same_kernels:
            return "kernels: same kernels in every inner step as in a single step"
        note = (" (the values agree on this CPU; another may round the two kernels apart)"
                if self.ok else "")
        return f"kernels differ: {self.kernels}{note}"

    def __str__(self):
        width = max(len(n) for n in self.per_variable)
        rows = [f"  {name:<{width}}  {diff:.3g}" for name, diff in self.per_variable.items()]
        return "\n".join([self.summary(), f"  {'name':<{width}}  max |Δ|"] + rows)


def max_abs_diff(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    with np.errstate(invalid="ignore"):  # inf - inf where only one side is inf
        diff = np.where(same, 0.0, np.abs(a64 - b64))
    return float(np.nan_to_num(diff, nan=np.inf).max())


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
