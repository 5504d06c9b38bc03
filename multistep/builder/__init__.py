"""The builder, ``ms.unroll``: a training step built from a loss function and a
``tf.compat.v1.train`` optimizer, then compiled by ``multistep.compiler``.

``step`` builds the canonical single step (``scopes``, ``phases``, ``inputs``,
``checks``); ``lint`` holds the rules it refuses a step by (stale forward pass, dangling
stateful op, stale capture); ``transforms`` and ``rules`` are the gradient transforms and
update rules; ``summaries`` the per-step summaries; ``auto`` chooses a mode by measuring;
``sampling`` the stateless candidate samplers.
"""
