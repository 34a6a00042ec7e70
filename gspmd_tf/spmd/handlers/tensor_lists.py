"""TensorList ops (tf.TensorArray, while-loop gradient accumulators, Keras RNNs): each
device holds a list of its shards of the elements.

A list has its element's shape in the IR (graph/tensor_lists.py); its rule
(rules.tensor_list) shares the element dims' factors between lists, items and stacked
tensors, the list index dim whole. Locally the op is the same TF op on the shards, with
the element_shape operand (where it has one) made the local element shape: every device
writes, reads, stacks and pops its own shards of the same elements at the same indices.
A list is never resharded (its shards are inside a variant): the partitioner keeps the
layout a list has (as it keeps a variable's) and reshards the items to it.
"""

from __future__ import annotations

import numpy as np

from gspmd_tf.propagation import rules
from gspmd_tf.registry import declare
from gspmd_tf.spmd.handlers.basic import replay

# op -> (element-shaped inputs, stacked inputs, element-shaped outputs, stacked outputs,
#        the element_shape input or None)
TENSOR_LIST_OPS = {
    "EmptyTensorList": ((), (), (0,), (), 0),
    "TensorListReserve": ((), (), (0,), (), 0),
    "TensorListFromTensor": ((), (0,), (0,), (), 1),
    "TensorListSetItem": ((0, 2), (), (0,), (), None),
    "TensorListPushBack": ((0, 1), (), (0,), (), None),
    "TensorListGetItem": ((0,), (), (0,), (), 2),
    "TensorListPopBack": ((0,), (), (0, 1), (), 1),
    "TensorListStack": ((0,), (), (), (0,), 1),
    "TensorListResize": ((0,), (), (0,), (), None),
    "TensorListLength": ((0,), (), (), (), None),
}


def local_tensor_list_op(ctx, operands, layouts):
    """The TF list op on the local shards, its element_shape the local one."""
    params = ctx.rule.params
    if params.shape_input is None:
        return replay(ctx, operands, layouts)
    local = ctx.dims_layout(params.element_dims).local_shape(ctx.mesh, params.element_shape)
    refs = [x.ref for x in operands]
    dtype = ctx.inputs[params.shape_input].dtype
    refs[params.shape_input] = ctx.b.const(np.asarray(local, dtype.as_numpy_dtype), dtype)
    return replay(ctx, operands, layouts, refs=refs)


declare(TENSOR_LIST_OPS, rules.tensor_list, emit=local_tensor_list_op)
