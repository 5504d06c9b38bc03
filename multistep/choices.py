"""The choices the command line offers, as plain data.

Kept apart from the modules that act on them so that ``multistep --help``
can list them without importing TensorFlow.
"""

__all__ = ["BENCH_METHODS", "BENCH_PROBLEMS", "MODES", "OPTIMIZERS"]

MODES = ("unrolled", "while_loop", "auto")

# Short name -> (tf.compat.v1.train class, keyword arguments beside the learning rate).
OPTIMIZERS = {
    "sgd": ("GradientDescentOptimizer", {}),
    "momentum": ("MomentumOptimizer", {"momentum": 0.9}),
    "nesterov": ("MomentumOptimizer", {"momentum": 0.9, "use_nesterov": True}),
    "adam": ("AdamOptimizer", {}),
    "rmsprop": ("RMSPropOptimizer", {}),
    "rmsprop-centered": ("RMSPropOptimizer", {"centered": True}),
    "adagrad": ("AdagradOptimizer", {}),
    "adadelta": ("AdadeltaOptimizer", {}),
    "ftrl": ("FtrlOptimizer", {}),
    "proximal-adagrad": ("ProximalAdagradOptimizer", {}),
    "proximal-sgd": ("ProximalGradientDescentOptimizer", {}),
}

BENCH_PROBLEMS = ("blobs", "mlp")
# The methods multistep.bench times, in its order (multistep.bench.METHODS has the code).
BENCH_METHODS = ("sess.run x N", "make_callable x N", "unrolled", "unrolled+xla", "while_loop",
                 "while_loop+xla", "auto", "compile unrolled", "compile while_loop",
                 "compile while_loop+xla", "tf1 xla loop (floor)", "tf1 xla loop+losses",
                 "tf.function", "tf.function+jit", "tf.function+jit+losses",
                 "tf2 tf.function x N", "tf2 tf.function+jit x N", "ms.tf2.fuse",
                 "ms.tf2.fuse+jit", "keras spe=N", "keras spe=N+jit", "keras spe=N+StepHistory",
                 "jax fori_loop", "jax fori_loop+losses")
