"""The dtypes TF's collective ops take: read by the backends, which emit the collectives,
and by the reshard planner, which plans a sum (planner.Broadcast) only for what they sum."""

from __future__ import annotations

import tensorflow as tf

# TF's collective kernels take float16/32/64 and int32/64 only; other dtypes travel as
# one of those that holds every value exactly (a bool "sum" comes back as OR).
CARRIERS = {tf.bool: tf.int32, tf.int8: tf.int32, tf.uint8: tf.int32, tf.int16: tf.int32,
            tf.uint16: tf.int32, tf.uint32: tf.int64, tf.bfloat16: tf.float32}

NATIVE = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def carries(dtype) -> bool:
    """True when TF's collective ops take `dtype`, as is or through a carrier dtype."""
    dtype = tf.as_dtype(dtype)
    return dtype in NATIVE or dtype in CARRIERS
