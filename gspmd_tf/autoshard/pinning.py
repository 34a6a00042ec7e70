"""The annotations that reproduce an auto-sharding plan without gt.AUTO.

The search sets the layout of every tensor it priced (search.py), so pinning only the
AUTO entries' chosen in_shardings does not give the same program: propagation from
them may choose other activations (a conv step's images are then not split spatially
and it is data parallel again, over the limit). `activation_hints` finds the
activations to annotate as well (gt.mesh_split where the function makes them): where
the plan departs from what propagation gives from the pinned shardings. With them the
lowering reproduces the plan's program (tests/test_auto_sharding.py).
"""

from __future__ import annotations

from typing import Optional

from gspmd_tf.graph.ir import Graph
from gspmd_tf.mesh import Mesh
from gspmd_tf.propagation.knobs import Knobs
from gspmd_tf.propagation.propagate import propagate

# Each round propagates the whole graph once; a plan needing more rounds is listed as
# far as they got, with the count of tensors still differing (the report says so).
ROUNDS = 8


def activation_hints(graph: Graph, mesh: Mesh, planned: dict, seeds: dict,
                     knobs: Optional[Knobs]) -> tuple:
    """({Ref: Layout} of the activations to annotate, how many of `planned`'s tensors
    propagation from `seeds` plus them still lays out otherwise). `planned` is the
    plan's {Ref: Layout}; `seeds` the pinned shardings (given and chosen entries).

    Each round annotates every tensor propagation lays out otherwise. A new annotation
    can move what propagates to a tensor that agreed before, so rounds repeat until all
    agree. Annotating only the first
    differing tensor of each chain was tried: fewer lines on the conv step, but on the
    Transformer step 155 tensors still differed after ROUNDS rounds."""
    hints = {}
    differing = ()
    for _ in range(ROUNDS):
        propagation = propagate(graph, mesh, {**seeds, **hints}, knobs=knobs)
        differing = [ref for ref, layout in planned.items()
                     if propagation.layout(ref) != layout]
        if not differing:
            break
        hints.update((ref, planned[ref]) for ref in differing)
    return hints, len(differing)


def hint_lines(graph: Graph, hints: dict, source_line) -> list:
    """The report's lines for `hints`: tensor name, spec and the user's source line
    (`source_line(op name)`, "" when unknown), in program order."""
    lines = []
    for ref in sorted(hints, key=lambda r: (r.node, r.out)):
        where = source_line(graph.nodes[ref.node].name)
        lines.append(f"  {graph.tensor_name(ref)}: {hints[ref].to_spec()}"
                     + (f"  ({where})" if where else ""))
    return lines

