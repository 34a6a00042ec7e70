"""Why the partitioner emits a collective: the op that needs it, the tensor it moves, the
two layouts it converts between, and a reason code.

The partitioner tells its ProgramBuilder the Origin of what it is emitting (the op it is
partitioning, and for a reshard the tensor and layouts); every collective the builder
emits meanwhile is recorded under its node name (ProgramBuilder.origins), and the
all-reduce combiner gives a combined all-reduce the origins of all its members.
Lowered.collectives() reads them back, adding the user's source line of the op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gspmd_tf.layout import Layout

# reason code -> what it means, in words (the codes gt.Reshard's `reason` attr uses too)
REASONS = {
    "contraction": "sums the partial results of a contraction or reduction over a split dim",
    "annotation": "a user sharding (gt.mesh_split, xla_sharding, in/out_shardings) asks "
                  "for this layout",
    "operand layout": "the op's rule computes it from another split of this operand (the "
                      "operands' shardings conflict, or the rule keeps a dim whole)",
    "uneven dim": "the operand splits a dim its mesh axes do not divide, and the op's rule "
                  "needs that dim split evenly or whole",
    "result layout": "the op computes its result split one way and propagation chose "
                     "another sharding for it (a consumer or annotation pulls elsewhere)",
    "no rule": "the op has no partitioning rule: it runs replicated on gathered operands",
    "op algorithm": "the op's own partitioned algorithm (halo exchange, rotation, "
                    "windowed loop, re-blocking)",
}

@dataclass(frozen=True)
class Origin:
    """Why one collective exists: graph op `op` needs it, for `reason` (a REASONS code);
    for a reshard, graph tensor `tensor` goes from layout `source` to `target`. `bytes`:
    for a member of a combined all-reduce, its own operand's bytes per device. `shared`:
    an op that needs a move another op needed first (the same tensor to the same
    layout), which the export pass lowered once: the collective's bytes count with the
    first op's origin, this one's are 0."""

    op: str
    reason: str
    tensor: str = ""
    source: Optional[Layout] = None
    target: Optional[Layout] = None
    bytes: int = 0
    shared: bool = False


def reshard_reason(asked: str, annotated: bool, source: Layout, target: Layout,
                   shape, mesh) -> str:
    """The reason code of a reshard from `source` to `target` of a tensor of global
    `shape` that the partitioner asked for as `asked` ("operand layout", "result layout",
    "no rule"), refined: a partial source is a contraction's sum, an op whose result
    carries a user sharding (`annotated`) moves for that annotation, and an operand
    split unevenly where the rule needs it even or whole is an uneven dim."""
    if source.partial and not set(source.partial) <= set(target.partial):
        return "contraction"
    if annotated:
        return "annotation"
    if asked != "operand layout":
        return asked
    for n, axes, kept in zip(shape, source.dims, target.dims):
        if axes and axes != kept and n % mesh.axes_size(axes):
            return "uneven dim"
    return "operand layout"
