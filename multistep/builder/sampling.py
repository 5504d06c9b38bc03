"""Stateless candidate samplers: the ``sampled_values`` of ``tf.nn.nce_loss`` and
``tf.nn.sampled_softmax_loss``, drawn from a seed the caller keys on the step.

TensorFlow's candidate samplers (``LogUniformCandidateSampler``, ...) are stateful:
each kernel call draws the next numbers of a stream, so N fused steps in one
``sess.run`` draw otherwise than N single steps, and ``ms.unroll`` warns. With
``seed=tf.stack([seed, global_step])`` the draw is a function of the step alone,
the same fused and single.
"""

import math

import tensorflow as tf

__all__ = ["log_uniform_candidates"]


def log_uniform_candidates(true_classes, num_sampled, range_max, seed):
    """``num_sampled`` classes from the log-uniform (Zipfian) distribution over
    ``[0, range_max)``, drawn with replacement from ``seed``, and their expected counts:
    what ``tf.random.log_uniform_candidate_sampler(..., unique=False)`` returns, without
    its stream state.

        P(c) = (log(c + 2) - log(c + 1)) / log(range_max + 1)
        c    = floor(exp(u * log(range_max + 1)) - 1) mod range_max,   u ~ U[0, 1)

    (TensorFlow's ``LogUniformSampler``); drawn ``num_sampled`` times with replacement,
    class c is expected ``num_sampled * P(c)`` times.

    Args:
      true_classes: int64 ``[batch, num_true]``, the labels.
      num_sampled: how many classes to draw.
      range_max: the number of classes.
      seed: int32 ``[2]``, e.g. ``tf.stack([7, tf.cast(global_step, tf.int32)])``.

    Returns:
      ``(sampled_candidates [num_sampled] int64, true_expected_count [batch, num_true]
      float32, sampled_expected_count [num_sampled] float32)``: pass it as
      ``sampled_values=``.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> s, t, e = ms.sampling.log_uniform_candidates(
      ...     tf.constant([[0], [3]], tf.int64), 4, 10, seed=tf.constant([1, 2]))
      >>> s.shape.as_list(), t.shape.as_list(), e.shape.as_list()
      ([4], [2, 1], [4])
    """
    if isinstance(range_max, bool) or not isinstance(range_max, int) or range_max < 1:
        raise ValueError(f"log_uniform_candidates: range_max must be an int >= 1 (the number "
                         f"of classes), got {range_max!r}.")
    if isinstance(num_sampled, bool) or not isinstance(num_sampled, int) or num_sampled < 1:
        raise ValueError(f"log_uniform_candidates: num_sampled must be an int >= 1, got "
                         f"{num_sampled!r}.")
    true_classes = tf.convert_to_tensor(true_classes)
    if true_classes.shape.rank != 2:
        raise ValueError(
            f"log_uniform_candidates: true_classes must be [batch, num_true] (as nce_loss's "
            f"labels), got shape {true_classes.shape}; a vector of labels y is y[:, None].")
    log_range = math.log(range_max + 1)
    u = tf.random.stateless_uniform([num_sampled], seed=seed, dtype=tf.float64)
    sampled = tf.math.floormod(tf.cast(tf.exp(u * log_range) - 1.0, tf.int64), range_max)

    def expected(classes):
        c = tf.cast(classes, tf.float64)
        p = (tf.math.log(c + 2.0) - tf.math.log(c + 1.0)) / log_range
        return tf.cast(p * num_sampled, tf.float32)

    return (tf.stop_gradient(sampled), tf.stop_gradient(expected(true_classes)),
            tf.stop_gradient(expected(sampled)))
