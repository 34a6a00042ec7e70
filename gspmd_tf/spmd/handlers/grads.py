"""Handlers for ops of TF's gradient code: Tile, BroadcastTo (shape arguments made
local). UnsortedSegment* ops are in segment.py, StridedSliceGrad in slicing.py."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.propagation import rules
from gspmd_tf.registry import op_family
from gspmd_tf.spmd.handlers.basic import local_shapes, masked_refs, replay


def index_dtype(ctx, attr):
    """numpy dtype of an int32/int64 index input whose type is attr `attr`."""
    dtype = ctx.node.attr(attr)
    return np.int64 if dtype == tf.int64 else np.int32


@op_family("Tile", rules.tile)
def tile(ctx, operands, layouts):
    """Tile: each dim's multiple is its local result size over its local input size
    (any multiple of an empty dim is empty)."""
    refs = masked_refs(ctx, operands)
    out = local_shapes(ctx, layouts)[0]
    local_in = ctx.b.shape_of(refs[0])
    multiples = [o // i if i else 1 for o, i in zip(out, local_in)]
    refs[1] = ctx.b.const(np.asarray(multiples, index_dtype(ctx, "Tmultiples")))
    return replay(ctx, operands, layouts, refs=refs)


@op_family("BroadcastTo", rules.broadcast_to)
def broadcast_to(ctx, operands, layouts):
    """BroadcastTo the local result shape."""
    refs = masked_refs(ctx, operands)
    shape = local_shapes(ctx, layouts)[0]
    refs[1] = ctx.b.const(np.asarray(shape, index_dtype(ctx, "Tidx")))
    return replay(ctx, operands, layouts, refs=refs)
