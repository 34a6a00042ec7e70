"""Matrix factorizations, inverses and solves on a batch of matrices, split along the
batch dims.

Each matrix (the last two dims) stays whole, so the TF op replayed on a device's block of
the batch gives that block's results. Qr replays as it is; the others also read the
padding of an uneven batch split, where TF's kernels fail (MatrixInverse, MatrixSolve: a
singular matrix) or log a warning for every matrix that is not positive definite
(Cholesky): those matrices are set to the identity first.
"""

from __future__ import annotations

import numpy as np

from gspmd_tf.propagation.rules import batched
from gspmd_tf.registry import declare, op_family
from gspmd_tf.spmd.handlers.basic import replay
from gspmd_tf.spmd.local_ops import mask_padding

declare("Qr", batched.matrices, replay=True)


@op_family({"Cholesky": (), "MatrixInverse": (), "MatrixSquareRoot": (),
           # (matrix, rhs): the right-hand sides share the batch dims
           "MatrixSolve": ((0, 1),), "MatrixTriangularSolve": ((0, 1),)},
          batched.matrices)
def identity_padded(ctx, operands, layouts):
    """The op replayed, padded matrices (operand 0) of split batch dims replaced by the
    identity."""
    x = operands[0]
    batch = range(len(x.shape) - 2)
    if not ctx.p.padded(x):
        return replay(ctx, operands, layouts)
    eye = np.eye(x.shape[-1], dtype=x.dtype.as_numpy_dtype)
    refs = [mask_padding(ctx.b, x, batch, eye)] + [y.ref for y in operands[1:]]
    return replay(ctx, operands, layouts, refs=refs)
