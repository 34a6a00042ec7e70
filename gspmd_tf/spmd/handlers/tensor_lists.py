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
import tensorflow as tf

from gspmd_tf.propagation import rules
from gspmd_tf.registry import declare
from gspmd_tf.spmd.handlers.basic import replay
from gspmd_tf.spmd.local_ops import select

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
    # tf.TensorArray.gather / scatter and their gradients
    "TensorListGather": ((0,), (), (), (0,), 2),
    "TensorListScatter": ((), (0,), (0,), (), 2),
    "TensorListScatterV2": ((), (0,), (0,), (), 2),
    "TensorListScatterIntoExistingList": ((0,), (1,), (0,), (), None),
}


def local_tensor_list_op(ctx, operands, layouts):
    """The TF list op on the local shards, its element_shape the local one."""
    params = ctx.rule.params
    if params.shape_input is None:
        return replay(ctx, operands, layouts)
    local = ctx.dims_layout(params.element_dims).local_shape(ctx.mesh, params.element_shape)
    refs = [x.ref for x in operands]
    refs[params.shape_input] = _known_dims_as(ctx, operands[params.shape_input].ref,
                                              params.shape_input, local)
    return replay(ctx, operands, layouts, refs=refs)


def element_shape(ctx, operands, layouts):
    """TensorListElementShape: the shape the list was declared with, as on one device.
    The local list was declared with the local sizes where the single-device one gave
    sizes (local_tensor_list_op), so the local op's value with those made the global
    sizes again; -1 (a dim declared unknown) stays -1."""
    params = ctx.rule.params
    [ref] = replay(ctx, operands, layouts)
    return [_known_dims_as(ctx, ref, None, params.element_shape)]


def _known_dims_as(ctx, ref, position, sizes):
    """The element_shape tensor `ref` (operand `position` of the node, or None: not an
    operand) with every known entry made `sizes`' and -1 entries kept, so a list is
    declared exactly as on one device up to its dims' sizes. A constant is folded; a
    scalar (unknown rank) passes as it is."""
    b = ctx.b
    dtype = b.graph.dtype(ref)
    if b.shape_of(ref) != (len(sizes),):
        return ref
    given = None if position is None else ctx.graph.const_value(ctx.node.inputs[position])
    wanted = np.asarray(sizes, dtype.as_numpy_dtype)
    if given is not None:
        return b.const(np.where(given < 0, given, wanted), dtype)
    unknown = b.op("Less", [ref, b.const(np.zeros((), dtype.as_numpy_dtype))], (len(sizes),),
                   tf.bool, T=dtype)
    return select(b, unknown, ref, b.const(wanted), dtype)


declare(TENSOR_LIST_OPS, rules.tensor_list, emit=local_tensor_list_op)
declare({"TensorListElementShape": ((0,), (), (), (), None)}, rules.tensor_list,
        emit=element_shape)
