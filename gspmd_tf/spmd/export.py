"""The export pass: the explicit-reshard program in, the SPMD program of collectives out.

The partitioner records every layout change it needs as a gt.Reshard node (program.py,
ProgramBuilder.reshard: the global shape, the source and target layouts, the op that
needs it and why) instead of emitting collectives inline, as Shardy's
insert-explicit-reshards does. This pass, like Shardy's reshard-to-collectives, lowers
each gt.Reshard to the steps the planner plans for it (reshard.reshard: planner.plan,
then reshard.emit's collectives and local pads and slices) and copies every other node,
control-flow bodies included. gt.Reshards of one tensor to one layout (the same move
needed by several ops) are lowered once, where the first is; its collectives carry
every needing op's origin (the later ones `shared`). Every node emitted for a
gt.Reshard is named `<its name>/...`, so a collective of the exported program leads back
to the gt.Reshard it came from (and its `needed_by` and `reason`) in the explicit one. Collectives an op's own algorithm needs (halo
exchanges, rotations, re-blocking, windowed einsum's permutes) are already in the
program: the handlers emit them, they are not layout changes.

Nothing else changes: the exported program is what emitting the collectives inline
gave, in the same order; the explicit one stays readable (base.program_text) and is
what the annotated graph for XLA's partitioner reads (runtime/annotated.py).
"""

from __future__ import annotations

from itertools import islice
from typing import Optional

from gspmd_tf.cost_model import CostModel
from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.mesh import Mesh
from gspmd_tf.spmd.program import RESHARD, Local, ProgramBuilder
from gspmd_tf.spmd.provenance import Origin
from gspmd_tf.spmd.reshard import reshard


def export(program: Graph, mesh: Mesh, cost_model: CostModel,
           origins: Optional[dict] = None) -> Graph:
    """`program` (an SPMD program with gt.Reshard nodes, its bodies too) with every
    gt.Reshard lowered to collectives planned on `cost_model`; a new Graph (the nodes of
    `program` are not changed). `origins` (collective node name -> provenance.Origins,
    ProgramBuilder.origins) gains each emitted collective's: its gt.Reshard's
    needed_by, reason, tensor and layouts."""
    b = ProgramBuilder(mesh, cost_model=cost_model)
    if origins is not None:
        b.origins = origins
    graph = b.graph
    new_ref = {}  # old node index -> its new Ref (a gt.Reshard's, one output)
    index = [-1] * len(program.nodes)  # old node index -> new node index (copies)
    lowered = {}  # (new operand Ref, source, target, shape) -> the new Ref
    emitted = {}  # the same key -> names of the collectives lowering it emitted

    def ref(old):
        moved = new_ref.get(old.node)
        return moved if moved is not None else Ref(index[old.node], old.out)

    for i, node in enumerate(program.nodes):
        if node.op == RESHARD:
            p = node.params
            operand = ref(node.inputs[0])
            key = (operand, p["source"], p["target"], p["shape"])
            origin = Origin(p["needed_by"], p["reason"], p.get("tensor") or "",
                            p["source"], p["target"], shared=key in lowered)
            if key not in lowered:
                b.prefix = f"{node.name}/"
                b.origin = origin
                known = len(b.origins)
                source = Local(operand, p["source"], p["shape"], node.out_dtypes[0])
                lowered[key] = reshard(b, source, p["target"]).ref
                b.origin = None
                emitted[key] = list(islice(reversed(b.origins), len(b.origins) - known))
            else:
                for name in emitted[key]:
                    b.origins[name] += (origin,)
            new_ref[i] = lowered[key]
            continue
        index[i] = graph.add(_copy(node, [ref(r) for r in node.inputs],
                                   [ref(Ref(c, 0)).node for c in node.control_inputs],
                                   [export(region, mesh, cost_model, b.origins)
                                    for region in node.regions]))
    graph.inputs = [ref(r) for r in program.inputs]
    graph.outputs = [ref(r) for r in program.outputs]
    return graph


def _copy(node: Node, inputs, control_inputs, regions) -> Node:
    """A new Node like `node` with other inputs and regions, sharing its attrs, params
    and output types (no pass changes those in place)."""
    copy = Node.__new__(Node)
    copy.name, copy.op, copy.attrs, copy.params = node.name, node.op, node.attrs, node.params
    copy.out_shapes, copy.out_dtypes = node.out_shapes, node.out_dtypes
    copy.inputs, copy.control_inputs, copy.regions = inputs, control_inputs, regions
    return copy
