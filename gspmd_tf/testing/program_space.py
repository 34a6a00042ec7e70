"""What the fuzzer's random programs are made of: meshes, dims, dtypes, op families and
the Tensor record the generator keeps per value (gspmd_tf.testing.generator builds the
programs; this module needs only numpy)."""

from __future__ import annotations

import numpy as np

MESHES = [(8,), (4,), (2,), (1,), (2, 4), (4, 2), (1, 8), (8, 1), (2, 2), (2, 2, 2),
          (1, 2, 4), (2, 1, 4), (4, 1, 2), (2, 4, 1), (1, 1, 8)]
AXIS_NAMES = [("x", "y", "z"), ("data", "model", "pipe"), ("a", "b", "c")]
DIMS = [1, 2, 3, 4, 5, 6, 7, 8, 12]
MAX_ELEMENTS = 384
FLOATS = ("float32", "float64", "float16", "bfloat16")
HALF = ("float16", "bfloat16")

# Op families (weights: how often each is drawn among the applicable ones).
FAMILIES = {
    "unary": 10, "binary": 10, "reshape": 8, "expand_squeeze": 3, "transpose": 5,
    "slice": 4, "strided_slice": 6, "pad": 4, "concat": 4, "tile": 3, "gather": 5,
    "one_hot": 2, "reduce": 8, "arg_reduce": 3, "softmax": 3, "cross_entropy": 2,
    "einsum": 5, "matmul": 5, "bias_add": 3, "conv": 4, "pool": 3, "segment": 3,
    "select": 3, "cast": 3, "add_n": 1, "broadcast": 2, "no_rule": 2,
}
# Families drawn only by control-flow programs (a fraction --control_flow_prob of them,
# decided by a random stream of their own, so every other program of a seed stays the
# same as before these families existed).
CONTROL_FLOW_FAMILIES = {"roll": 12, "while": 15, "cond": 12}

# Shape-preserving steps of while bodies and cond branches ({v}: the value stepped). They
# keep values bounded over a few iterations and make no NaN/Inf of finite values.
BODY_UNARY = ["tf.tanh({v})", "tf.sin({v})", "tf.nn.relu({v})", "tf.negative({v})",
              "tf.abs({v})", "tf.sigmoid({v})", "{v} * 0.5"]
BODY_BINARY = ["tf.add", "tf.subtract", "tf.maximum", "tf.minimum"]

# Elementwise ops by dtype class. "ill" ops amplify rounding differences (division by a
# small value, discontinuities): they are not applied to tensors whose value depends on
# summation order, since a partitioned sum legitimately rounds differently.
UNARY_FLOAT = ["tf.nn.relu", "tf.tanh", "tf.exp", "tf.sigmoid", "tf.negative", "tf.square",
               "tf.abs", "tf.nn.elu", "tf.nn.softplus", "tf.nn.relu6", "tf.nn.leaky_relu",
               "tf.sin", "tf.zeros_like", "tf.ones_like", "tf.identity", "tf.stop_gradient",
               "tf.math.is_nan", "tf.math.is_finite", "tf.math.is_inf"]
UNARY_FLOAT_ILL = ["tf.math.log1p", "tf.sqrt", "tf.math.reciprocal", "tf.math.floor",
                   "tf.math.sign", "tf.math.round", "tf.math.rsqrt"]
UNARY_INT = ["tf.negative", "tf.abs", "tf.square", "tf.math.sign", "tf.identity",
             "tf.zeros_like"]
UNARY_BOOL = ["tf.math.logical_not", "tf.identity"]
BINARY_FLOAT = ["tf.add", "tf.subtract", "tf.multiply", "tf.maximum", "tf.minimum",
                "tf.math.squared_difference"]
BINARY_FLOAT_ILL = ["tf.divide", "tf.math.divide_no_nan", "tf.equal", "tf.less",
                    "tf.greater_equal", "tf.math.floormod"]
BINARY_INT = ["tf.add", "tf.subtract", "tf.multiply", "tf.maximum", "tf.minimum",
              "tf.equal", "tf.less", "tf.greater_equal"]
BINARY_BOOL = ["tf.math.logical_and", "tf.math.logical_or", "tf.equal",
               "tf.math.logical_xor"]
BOOL_RESULT = {"tf.math.is_nan", "tf.math.is_finite", "tf.math.is_inf", "tf.equal",
               "tf.less", "tf.greater_equal"}
# the ops that may turn finite values into NaN/Inf
NONFINITE_MAKERS = {"tf.exp", "tf.math.log1p", "tf.sqrt", "tf.math.reciprocal",
                    "tf.math.rsqrt", "tf.divide", "tf.math.floormod", "tf.square",
                    "tf.multiply", "tf.math.squared_difference"}


def loosest(dtypes):
    """The least precise of some dtypes (non-float ones ignored; None if none)."""
    floats = [d for d in dtypes if d in FLOATS]
    return max(floats, key=lambda d: PRECISION_RANK[d]) if floats else None


PRECISION_RANK = {"float64": 0, "float32": 1, "float16": 2, "bfloat16": 3}


class Tensor:
    """What the generator knows of one tensor of the program being built."""

    def __init__(self, name, shape, dtype, rounded=False, nonfinite=False, precision=None):
        self.name = name
        self.shape = list(shape)
        self.dtype = dtype
        self.rounded = rounded      # value depends on summation order
        self.nonfinite = nonfinite  # may hold NaN/Inf
        # the least precise float type the value went through (decides the tolerance)
        self.precision = loosest([precision, dtype])

    @property
    def rank(self):
        """Number of dims."""
        return len(self.shape)

    @property
    def size(self):
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def is_float(self):
        """Whether the dtype is a float."""
        return self.dtype in FLOATS
