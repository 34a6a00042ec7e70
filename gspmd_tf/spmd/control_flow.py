"""Partitioned control flow: While / If / Case with SPMD sub-programs as their bodies.

Each region of a control-flow op is partitioned ONCE, by a partitioner of its own, into
a sub-program with local shapes and its own collectives; the op is emitted on local
operands with those sub-programs as its regions, so every iteration of a loop (every
call of a branch) runs the same partitioned body, as XLA's HandleWhile and
HandleConditional do.

Layouts at the boundary (propagation tied them, propagation/regions.py; where a user
annotation made them differ, a reshard at the edge reconciles them):
- While: loop value k has the layout propagation gave body parameter k; the operand is
  resharded to it, the body's result k leaves the body in it, cond and body take it;
- If / Case: operand j keeps its own layout (each branch reshards inside if it wants
  another), branch result j leaves in the layout of the op's result j;
- a variable handle passes as it is: a device's handle points to its shard, and the
  bodies read and update that shard as top-level code does; a TensorList passes as it
  is too (it holds each device's shards of its elements).
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import REGION_OPS
from gspmd_tf.layout import Layout
from gspmd_tf.spmd.program import UNMOVABLE, Local


def partition_control_flow(p, index, operands, targets):
    """Emit control-flow node `index` of partitioner `p` on its operands (Locals);
    returns its results (Locals) in the layouts its regions produce. Each region is
    partitioned by `p.region_partitioner` (the partitioner passes itself: this module
    does not import it)."""
    node = p.graph.nodes[index]
    first = REGION_OPS[node.op][1]
    loop = "While" in node.op
    passed = operands[first:]
    if loop:
        body_params = p.propagation.region(index, len(node.regions) - 1)
        body = node.regions[-1]
        layouts = [x.layout if x.dtype in UNMOVABLE else body_params.layout(ref)
                   for x, ref in zip(passed, body.inputs)]
        result_layouts = layouts
    else:
        layouts = [x.layout for x in passed]
        # a handle result leaves each branch as it is (it cannot be resharded)
        result_layouts = [None if dtype in UNMOVABLE else Layout(t.dims)
                          for t, dtype in zip(targets, node.out_dtypes)]
    names = [p.graph.tensor_name(ref) for ref in node.inputs]
    passed = [x if x.dtype in UNMOVABLE else p.reshard(x, layout, tensor=name)
              for x, layout, name in zip(passed, layouts, names[first:])]
    # the predicate or branch index: a scalar every device holds
    selectors = [p.reshard(x, Layout.replicated(len(x.shape)), tensor=name)
                 for x, name in zip(operands[:first], names)]
    programs, produced = [], []
    for r, region in enumerate(node.regions):
        outs = [Layout.replicated(0)] if loop and r == 0 else result_layouts
        sub = p.region_partitioner(region, p.propagation.region(index, r),
                                   prefix=f"{node.name}/{r}/")
        program, out_layouts = sub.partition_region(layouts, outs)
        programs.append(program)
        if not (loop and r == 0):
            produced.append(out_layouts)
    if not loop:
        result_layouts = _branches_agree(node, produced)
    shapes = [p.local_shape(layout, shape)
              for layout, shape in zip(result_layouts, node.out_shapes)]
    refs = p.b.replay(node, [x.ref for x in selectors + passed], shapes, node.out_dtypes,
                      _local_output_shapes(node, shapes), programs)
    return [Local(ref, layout, shape, dtype) for ref, layout, shape, dtype
            in zip(refs, result_layouts, node.out_shapes, node.out_dtypes)]


def _local_output_shapes(node, shapes):
    """The node's `output_shapes` attr with local shapes (handles keep theirs)."""
    if "output_shapes" not in node.attrs:
        return {}
    listed = list(node.attrs["output_shapes"].list.shape)
    for k, (shape, dtype) in enumerate(zip(shapes, node.out_dtypes)):
        if dtype not in UNMOVABLE and k < len(listed):
            listed[k] = tf.TensorShape(shape).as_proto()
    return {"output_shapes": attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(shape=listed))}


def _branches_agree(node, produced):
    """The layouts of a branch op's results: every branch's, which must agree (they do
    but for handles, which leave each branch in the layout they have)."""
    for k, layouts in enumerate(zip(*produced)):
        if len(set(layouts)) > 1:
            raise ShardingError(
                f"op {node.name!r} ({node.op}): its branches return result {k} (a variable "
                "handle or a TensorList) split differently, "
                f"{' vs '.join(repr(layout.to_spec()) for layout in layouts)}, and it cannot "
                "be resharded; split what the branches write into it the same way")
    return list(produced[0])

