"""TensorLists get the shape of their elements in the IR.

A TensorList (tf.TensorArray, tf.while_loop's gradient accumulators, Keras RNNs) is a
scalar variant to TF. In the IR it has the shape of one element instead, as a variable
handle has its variable's shape, so that propagation and the partitioner treat a list as
standing for its elements: a list of split elements stays split (the list index is never
split: every device holds every element's shard).

TF's handle data cannot be trusted for this: a tf.TensorArray's TensorListReserve (and
the loop carrying it) often has an unknown element shape while the SetItem results in the
body know it. So the element shape is inferred per family of list tensors that are one
list (a list op's list in and list out, Identity, a loop's operand, parameters, body
result and result, a branch op's operands and parameters, results and branch results),
from what the family's ops say about the elements: the items written or read, a stacked
or unstacked tensor, a constant element_shape. A family whose evidence is missing or
disagrees keeps shape () (its ops then have no rule and run replicated).
"""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf.disjoint_sets import DisjointSets
from gspmd_tf.graph.ir import Ref, walk

_VARIANT = frozenset({tf.variant})

# ops whose output 0 is a list of the elements of their list input (at this position):
# the list updated, passed on, or (ZerosLike, in TF's gradients) zeros like it
LIST_IN_OUT = {"TensorListSetItem": 0, "TensorListPushBack": 0, "TensorListPopBack": 0,
                "TensorListResize": 0, "TensorListScatterIntoExistingList": 0,
                "Identity": 0, "ZerosLike": 0}


def _element_evidence(graph, node):
    """[(list Ref, element shape)]: what op `node` says about the elements of the lists
    it reads."""
    op, ins, outs = node.op, node.inputs, node.out_shapes
    if op == "TensorListSetItem":
        return [(ins[0], graph.shape(ins[2]))]
    if op == "TensorListPushBack":
        return [(ins[0], graph.shape(ins[1]))]
    if op == "TensorListGetItem":
        return [(ins[0], outs[0])]
    if op == "TensorListPopBack":
        return [(ins[0], outs[1])]
    if op in ("TensorListStack", "TensorListGather"):
        return [(ins[0], outs[0][1:])]
    if op == "TensorListScatterIntoExistingList":
        return [(ins[0], graph.shape(ins[1])[1:])]
    return []


def _made_with(graph, node, index):
    """(list Ref, element shape) of a list op that makes a list, when it says."""
    if node.op in ("TensorListFromTensor", "TensorListScatter", "TensorListScatterV2"):
        return Ref(index, 0), graph.shape(node.inputs[0])[1:]
    if node.op in ("EmptyTensorList", "TensorListReserve"):
        value = graph.const_value(node.inputs[0])
        if value is not None and value.ndim == 1 and (value >= 0).all():
            return Ref(index, 0), tuple(int(v) for v in value)
    return None


def infer_element_shapes(graph):
    """Give every TensorList tensor of `graph` and its regions its element shape (see
    the module); returns `graph`."""
    # most programs have no lists: one quick scan (set look-ups, not DType.__eq__)
    if all(_VARIANT.isdisjoint(node.out_dtypes) for node in walk(graph)):
        return graph
    families, evidence, tensors = DisjointSets(), [], []
    _collect(graph, families, evidence, tensors)
    shapes = {}
    for key, shape in evidence:
        root = families.find(key)
        shapes[root] = shape if shapes.get(root, shape) == shape else None
    for g, ref in tensors:
        shape = shapes.get(families.find((id(g), ref)))
        if shape is not None:
            g.nodes[ref.node].out_shapes[ref.out] = tuple(shape)
    return graph


def _collect(graph, families, evidence, tensors):
    """Record the variant tensors of `graph` and its regions, their families and the
    evidence about their elements."""
    gid = id(graph)
    for index, node in enumerate(graph.nodes):
        for k, dtype in enumerate(node.out_dtypes):
            if dtype == tf.variant:
                tensors.append((graph, Ref(index, k)))
        position = LIST_IN_OUT.get(node.op)
        if position is not None and node.inputs and node.out_dtypes and \
                node.out_dtypes[0] == tf.variant and \
                graph.dtype(node.inputs[position]) == tf.variant:
            families.union((gid, node.inputs[position]), (gid, Ref(index, 0)))
        evidence += [((gid, ref), shape) for ref, shape in _element_evidence(graph, node)
                     if graph.dtype(ref) == tf.variant]
        made = _made_with(graph, node, index)
        if made is not None:
            evidence.append(((gid, made[0]), made[1]))
        if node.regions:
            _tie_regions(graph, index, node, families)
            for region in node.regions:
                _collect(region, families, evidence, tensors)


def _tie_regions(graph, index, node, families):
    """A control-flow op's lists are one family with its regions' parameters and
    results (as propagation ties them)."""
    gid = id(graph)
    operands = node.region_operands()
    loop = "While" in node.op
    for region in node.regions:
        rid = id(region)
        for k, ref in enumerate(operands):
            if graph.dtype(ref) == tf.variant:
                families.union((gid, ref), (rid, region.inputs[k]))
                if loop:
                    families.union((gid, ref), (gid, Ref(index, k)))
        is_body = region is node.regions[-1]
        for k, ref in enumerate(region.outputs):
            if region.dtype(ref) != tf.variant or (loop and not is_body):
                continue
            families.union((gid, Ref(index, k)), (rid, ref))

