"""The clean-ups an imported graph goes through before propagation: named passes run in
order, as XLA's HloPassPipeline runs HLO passes. The importer runs REGION_PASSES on each
control-flow body as it imports it and IMPORT_PASSES on the whole graph.

  mask-summed-row-picks  TF's gradient of a ConcatV2 fed a sparse gradient picks rows
                         with a Where (a value-dependent shape); where the rows are only
                         summed they are masked instead (sparse_rows.py)
  identities-apart       an IdentityN (tf.custom_gradient's, Keras') becomes one
                         Identity per output, so each keeps its own sharding
                         (identity_n.py)
  fold                   shape computations become constants, the shapes they decide
                         are inferred (fold.py)
  rotations-as-rolls     slices and a concat that rotate a tensor become one Roll
                         (rotate.py; the top-level graph only)
  tensor-list-shapes     TensorLists take the shape of their elements, through the
                         regions too (tensor_lists.py)

Dead-code elimination (dce.py) is a helper of these passes and of the partitioner, not a
pass: the importer keeps every op the trace has (a variable update is needed though no
output reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from gspmd_tf.graph.fold import fold
from gspmd_tf.graph.identity_n import identities_apart
from gspmd_tf.graph.ir import Graph
from gspmd_tf.graph.rotate import rotations_as_rolls
from gspmd_tf.graph.sparse_rows import mask_summed_row_picks
from gspmd_tf.graph.tensor_lists import infer_element_shapes


@dataclass(frozen=True)
class GraphPass:
    """One clean-up: `run(graph)` rewrites `graph` and returns it."""

    name: str
    run: Callable[[Graph], Graph]


REGION_PASSES = (GraphPass("mask-summed-row-picks", mask_summed_row_picks),
                 GraphPass("identities-apart", identities_apart),
                 GraphPass("fold", fold))
IMPORT_PASSES = REGION_PASSES + (GraphPass("rotations-as-rolls", rotations_as_rolls),
                                 GraphPass("tensor-list-shapes", infer_element_shapes))


def run_passes(graph: Graph, passes: Sequence[GraphPass]) -> Graph:
    """`graph` after each of `passes`, in order."""
    for graph_pass in passes:
        graph = graph_pass.run(graph)
    return graph
