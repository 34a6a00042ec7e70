"""Handlers: how each op family is emitted on local shards.

A handler is `emit(ctx, operands, layouts) -> [Ref]`: `operands` are the op's inputs
already resharded to the factor axes the partitioner chose, `layouts` the layouts its
results have as computed (partial over split reduced factors). Ops not listed here are
re-created as they are (`replay`), which is right for any op whose rule fully describes
it (elementwise, dots, transposes, concat...).
"""

from gspmd_tf.spmd.handlers.basic import BASIC_HANDLERS, replay
from gspmd_tf.spmd.handlers.conv import CONV_HANDLERS
from gspmd_tf.spmd.handlers.einsum import EINSUM_HANDLERS
from gspmd_tf.spmd.handlers.gather import GATHER_HANDLERS
from gspmd_tf.spmd.handlers.grads import GRAD_HANDLERS
from gspmd_tf.spmd.handlers.normalize import NORMALIZE_HANDLERS
from gspmd_tf.spmd.handlers.segment import SEGMENT_HANDLERS

HANDLERS = {**BASIC_HANDLERS, **GATHER_HANDLERS, **NORMALIZE_HANDLERS, **GRAD_HANDLERS,
            **CONV_HANDLERS, **SEGMENT_HANDLERS, **EINSUM_HANDLERS}

__all__ = ["HANDLERS", "replay"]
