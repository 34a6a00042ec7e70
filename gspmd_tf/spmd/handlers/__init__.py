"""Handlers: how each op family is emitted on local shards, declared with its rule.

A handler is `emit(ctx, operands, layouts) -> [Ref]`: `operands` are the op's inputs
already resharded to the factor axes the partitioner chose, `layouts` the layouts its
results have as computed (partial over split reduced factors). A handler may return
Locals instead of Refs when it combines partial results itself. Each module declares its
op families in the op registry (gspmd_tf/registry.py) beside their handlers, with
`@op_family(op types, rule builder)`; replayed.py declares the families whose TF op
replayed on local shapes (`replay`) is exact. Importing this package loads them all.
"""

# every module declares its families when imported
from gspmd_tf.spmd.handlers import (basic, batch_norm, conv, einsum, gather,  # noqa: F401
                                    grads, linalg, normalize, py_functions, replayed,
                                    reshape, resize, roll, segment, slicing, tensor_lists)
from gspmd_tf.spmd.handlers.basic import replay

__all__ = ["replay"]
