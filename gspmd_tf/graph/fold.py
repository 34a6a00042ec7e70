"""Fold shape computations of an imported graph to constants.

Gradient code (and user code) computes shapes, axes and multiples with small ops: Shape,
Size, BroadcastGradientArgs, StridedSlice of a shape, ConcatV2, FloorDiv... With static
shapes all of them are constants. Folding them lets the rules of the ops that read them
(Reshape, Sum, Tile, UnsortedSegmentSum...) see constant arguments, and keeps shape
arithmetic out of the partitioner (where it would run replicated, without a rule).

`fold(graph)` rewrites the IR in place (after the rows picked by a data-dependent Where
and only summed are masked: sparse_rows.py, run before it by graph/passes.py):
  - Shape/ShapeN/Size/Rank of any tensor become constants (every shape is static);
  - pure ops (declared fold=FOLD_VALUES in the op registry) whose inputs are all
    constants, and whose result is small, are evaluated with TF (eagerly, on the CPU) and become constants;
  - tensors the importer left with an unknown shape (outputs of ops of the registry's
    VALUE_SHAPED trait, whose
    shape depends on input values, and their consumers) get the shape of their folded
    value, or else the shape TF's shape inference gives once the inputs are constants;
    a tensor still unknown is a ShardingError.
A folded node becomes a "Const" node (attrs dtype and value) with the same name and
index, no data inputs, and its control inputs kept, so every Ref to it stays valid. A
folded node with several outputs (ShapeN, BroadcastGradientArgs, Unpack) becomes one
Const per output: the extra ones (named "<name>/output_<k>") are inserted before it and
every Ref of the graph is renumbered.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Node, Ref
from gspmd_tf.graph.sparse_rows import renumber
from gspmd_tf.registry import FOLD_SHAPE, FOLD_VALUES, op_def

MAX_ELEMENTS = 100_000  # no folded constant is larger
SMALL_FLOAT = 64  # floating results larger than their inputs fold only up to this size

def fold(graph):
    """Fold constant shape computations of `graph` in place (see the module docstring);
    returns `graph`. Runs after mask-summed-row-picks (graph/passes.py)."""
    unknown = getattr(graph, "unknown_shapes", None) or {}
    values = {}  # node index -> [np.ndarray per output] of constants read so far
    multi = []  # folded nodes with several outputs: (index, [(value, dtype)])
    for index, node in enumerate(graph.nodes):
        outs = _fold_node(graph, index, node, values, unknown)
        if outs is None:
            if unknown and any((index, k) in unknown for k in range(len(node.out_shapes))):
                _infer_shapes(graph, index, node, values, unknown)
            continue
        values[index] = outs
        for k, value in enumerate(outs):
            node.out_shapes[k] = tuple(value.shape)
            unknown.pop(Ref(index, k), None)
        if len(outs) > 1:
            multi.append((index, list(zip(outs, node.out_dtypes))))
        # the extra outputs stay on the node until _split_outputs: consumers folded
        # later in this pass read their dtypes (BroadcastGradientArgs' second output)
        _make_const(node, outs[0], keep_outputs=len(outs) > 1)
    if unknown:
        ref = min(unknown)
        name = graph.tensor_name(ref)
        if graph.nodes[ref.node].op == "Where":
            raise ShardingError(
                f"tensor '{name}' (Where) has shape {unknown[ref]}: the number of true "
                "elements of its input, which depends on the input's values; gspmd-tf "
                "needs static shapes: keep every element instead (e.g. tf.where(cond, x, "
                "0) with three arguments rather than tf.boolean_mask or tf.where(cond))")
        raise ShardingError(
            f"tensor '{name}' has shape {unknown[ref]} with unknown dimensions; gspmd-tf "
            "needs static shapes: trace with fully defined shapes (e.g. pass "
            "tf.TensorSpec with a full shape)")
    if hasattr(graph, "unknown_shapes"):
        del graph.unknown_shapes
    if multi:
        _split_outputs(graph, multi)
    return graph


def _const_of(graph, ref, values):
    """numpy value of a constant tensor (small ones only), or None."""
    cached = values.get(ref.node)
    if cached is not None:
        return cached[ref.out]
    node = graph.nodes[ref.node]
    if node.op != "Const" or math.prod(node.out_shapes[0]) > MAX_ELEMENTS:
        return None
    value = np.asarray(node.attr("value"))
    values[ref.node] = [value]
    return value


def _fold_node(graph, index, node, values, unknown):
    """The constant outputs of `node` (list of np.ndarray), or None when it stays."""
    folds = op_def(node.op).fold
    if folds == FOLD_SHAPE:
        return _shape_op(graph, node, unknown)
    if folds != FOLD_VALUES or not node.inputs:
        return None
    nodes = graph.nodes
    # the usual answer first: an input that is neither a constant nor folded
    if any(ref.node not in values and nodes[ref.node].op != "Const" for ref in node.inputs):
        return None
    shapes_known = not unknown or all((index, k) not in unknown
                                      for k in range(len(node.out_shapes)))
    if shapes_known:
        n_out = sum(math.prod(s) for s in node.out_shapes)
        if n_out > MAX_ELEMENTS:
            return None
    inputs = []
    for ref in node.inputs:
        if ref in unknown:
            return None
        value = _const_of(graph, ref, values)
        if value is None:
            return None
        inputs.append(value)
    if shapes_known and any(not (d.is_integer or d == tf.bool) for d in node.out_dtypes):
        n_in = sum(v.size for v in inputs)
        if n_out > max(n_in, SMALL_FLOAT):  # do not turn small data into big constants
            return None
    outs = _evaluate(graph, node, inputs)
    if outs is None or sum(v.size for v in outs) > MAX_ELEMENTS:
        return None
    return outs


def _shape_op(graph, node, unknown):
    """Shape/ShapeN/Size/Rank of statically shaped tensors; VariableShape of a handle
    that can be followed to its variable."""
    dtype = node.attr("out_type", tf.int32)
    np_dtype = dtype.as_numpy_dtype
    if node.op == "VariableShape":
        shape = _variable_shape(graph, node.inputs[0])
        return None if shape is None else [np.asarray(shape, np_dtype).reshape(len(shape))]
    if any(ref in unknown or graph.dtype(ref) in (tf.resource, tf.variant)
           for ref in node.inputs):  # a handle's IR shape is not its TF shape
        return None
    shapes = [graph.shape(ref) for ref in node.inputs]
    if node.op == "Shape":
        return [np.asarray(shapes[0], np_dtype).reshape(len(shapes[0]))]
    if node.op == "ShapeN":
        return [np.asarray(s, np_dtype).reshape(len(s)) for s in shapes]
    if node.op == "Size":
        return [np.asarray(np.prod(shapes[0], dtype=np.int64), np_dtype)]
    return [np.asarray(len(shapes[0]), np.int32)]  # Rank


def _variable_shape(graph, ref):
    """The shape of the variable behind handle `ref`, or None when it is not known: read
    where the importer recorded it (an argument, a region parameter), following the
    handle through Identity and through a While that hands it on unchanged (TF's loops
    pass every handle they read through their body)."""
    node = graph.nodes[ref.node]
    if "var_shape" in node.params:
        return node.params["var_shape"]
    if node.op == "Identity":
        return _variable_shape(graph, node.inputs[0])
    if node.op in ("While", "StatelessWhile"):
        body = node.regions[1]
        out = body.outputs[ref.out]
        while body.nodes[out.node].op == "Identity":
            out = body.nodes[out.node].inputs[0]
        if out == body.inputs[ref.out]:
            return _variable_shape(graph, node.inputs[ref.out])
    return None


def _evaluate(graph, node, inputs):
    """Run `node` eagerly on constant inputs; None when TF cannot (or the op fails)."""
    from tensorflow.python.eager import context, execute

    attrs = []
    for name, value in node.attrs.items():
        decoded = _eager_attr(value)
        if decoded is _UNSUPPORTED:
            return None
        attrs += [name, decoded]
    try:
        with tf.init_scope(), tf.device("/device:CPU:0"):
            tensors = [tf.constant(v, dtype=graph.dtype(ref))
                       for v, ref in zip(inputs, node.inputs)]
            outs = execute.execute(node.op, len(node.out_dtypes), tensors, tuple(attrs),
                                   context.context())
    except Exception:  # pylint: disable=broad-except  (folding is optional: keep the op)
        return None
    return [np.asarray(t.numpy()) for t in outs]


_UNSUPPORTED = object()


def _eager_attr(value):
    """An AttrValue as the python value eager execution takes."""
    kind = value.WhichOneof("value")
    if kind == "list":
        lst = value.list
        if lst.func or lst.tensor:
            return _UNSUPPORTED
        for field in ("i", "f", "b", "s", "type", "shape"):
            items = list(getattr(lst, field))
            if items:
                return [_eager_scalar(field, item) for item in items]
        return []
    if kind in (None, "func", "placeholder", "tensor"):
        return _UNSUPPORTED
    return _eager_scalar(kind, getattr(value, kind))


def _eager_scalar(kind, item):
    if kind == "shape":
        return None if item.unknown_rank else [d.size for d in item.dim]
    return item  # ints, floats, bools, bytes, DataType enums


def _make_const(node, value, keep_outputs=False):
    """Turn `node` into a Const node holding `value` (its first output); its other
    outputs are dropped unless `keep_outputs`."""
    dtype = node.out_dtypes[0]
    node.op = "Const"
    node.inputs = []
    node.attrs = {
        "dtype": attr_value_pb2.AttrValue(type=dtype.as_datatype_enum),
        "value": attr_value_pb2.AttrValue(
            tensor=tf.make_tensor_proto(np.asarray(value, dtype.as_numpy_dtype))),
    }
    if not keep_outputs:
        del node.out_shapes[1:]
        del node.out_dtypes[1:]


def _infer_shapes(graph, index, node, values, unknown):
    """Shapes of a deferred node's outputs from TF's shape inference, with its constant
    inputs given as constants (the others as placeholders of their static shapes); when
    every other input has no elements, from running the op on empty inputs (TF's
    inference leaves e.g. the -1 of a reshape of no elements unknown, its kernel does
    not)."""
    if any(ref in unknown for ref in node.inputs):
        return
    consts = [_const_of(graph, ref, values) for ref in node.inputs]
    if all(v is not None or (0 in graph.shape(ref) and graph.dtype(ref).is_numpy_compatible)
           for v, ref in zip(consts, node.inputs)):
        outs = _evaluate(graph, node, [
            v if v is not None else np.zeros(graph.shape(ref), graph.dtype(ref).as_numpy_dtype)
            for v, ref in zip(consts, node.inputs)])
        if outs is not None:
            for k, value in enumerate(outs):
                node.out_shapes[k] = tuple(value.shape)
                unknown.pop(Ref(index, k), None)
            return
    g = tf.Graph()
    try:
        with g.as_default():
            inputs = []
            for ref in node.inputs:
                value = _const_of(graph, ref, values)
                dtype = graph.dtype(ref)
                inputs.append(tf.constant(value, dtype) if value is not None
                              else tf.compat.v1.placeholder(dtype, graph.shape(ref)))
            op = g.create_op(node.op, inputs, list(node.out_dtypes), attrs=node.attrs,
                             compute_device=False)
    except Exception:  # pylint: disable=broad-except  (then the shape stays unknown)
        return
    for k, t in enumerate(op.outputs):
        if t.shape.is_fully_defined():
            node.out_shapes[k] = tuple(t.shape.as_list())
            unknown.pop(Ref(index, k), None)


def _split_outputs(graph, multi):
    """Insert a Const for every extra output of the folded multi-output nodes, and
    renumber every Ref and node index of the graph."""
    extra = dict(multi)
    old_nodes = graph.nodes
    new_index = {}  # old node index -> new node index
    new_ref = {}  # (old node, out) -> new Ref, for the split outputs
    graph.nodes, graph._by_name = [], {}
    for i, node in enumerate(old_nodes):
        for k, (value, dtype) in enumerate(extra.get(i, ())[1:], start=1):
            const = Node(f"{node.name}/output_{k}", "Const", out_shapes=[value.shape],
                         out_dtypes=[dtype], control_inputs=node.control_inputs)
            _make_const(const, value)
            new_ref[(i, k)] = Ref(graph.add(const), 0)
        if i in extra:  # its other outputs are the Consts just added
            del node.out_shapes[1:]
            del node.out_dtypes[1:]
        new_index[i] = graph.add(node)

    renumber(graph, new_index, new_ref)
