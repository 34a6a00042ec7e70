"""Per-layer accounting of a lowered program: collectives, their bytes and the bytes of
the tensors each layer's ops produce on one device, grouped by name scope (a Keras
layer's path, e.g. "sequential/dense_1"), as PyTorch DTensor's CommDebugMode counts
per module.

An op's layer is its name scope (its name without the last component; a scope that is
itself an op's name, e.g. the constant "mul_1/y" of op "mul_1", gives way to that op's
own scope); the gradient
ops TF names "gradient_tape/<forward op's path>/..." count in the forward layer they
differentiate: the longest scope of a forward op that starts their path (none: a
top-level op's). Ops at the top level form the layer "(top)". A collective counts in the layer of the op that needs
it (each origin of a combined all-reduce in its own op's layer, with that member's
bytes: such an all-reduce counts once per member).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOP = "(top)"
_GRADIENT = "gradient_tape/"


@dataclass
class LayerStats:
    """One layer (name scope): its ops, the collectives they need and those
    collectives' bytes per device, and `tensor_bytes`: the bytes per device of the
    tensors its ops produce (under their shardings)."""

    layer: str
    ops: int = 0
    collectives: int = 0
    collective_bytes: int = 0
    tensor_bytes: int = 0


class LayerOf:
    """op name -> its layer (see the module doc), for the ops of one graph."""

    def __init__(self, names):
        names = list(names)
        self._ops = set(names)
        self._scopes = {self._scope(name) for name in names
                        if "/" in name and not name.startswith(_GRADIENT)} - {""}
        # every enclosing scope of a forward op is a scope too
        for scope in list(self._scopes):
            parts = scope.split("/")
            self._scopes.update("/".join(parts[:end]) for end in range(1, len(parts)))

    def _scope(self, name):
        """The scope of forward op `name` ("" at the top), skipping scopes that are op
        names."""
        scope = name.rsplit("/", 1)[0] if "/" in name else ""
        while scope in self._ops:
            scope = scope.rsplit("/", 1)[0] if "/" in scope else ""
        return scope

    def __call__(self, name: str) -> str:
        if not name.startswith(_GRADIENT):
            return self._scope(name) or TOP
        parts = name[len(_GRADIENT):].split("/")[:-1]
        for end in range(len(parts), 0, -1):
            scope = "/".join(parts[:end])
            if scope in self._scopes:
                return scope
        return TOP  # the gradient of a top-level op


def layer_stats(lowered) -> list:
    """LayerStats of every layer of `lowered` (a gt.Lowered), in order of first op."""
    graph, mesh, layouts = lowered.graph, lowered.mesh, lowered.propagation.layouts
    layer_of = LayerOf([node.name for node in graph.nodes])
    stats = {}

    def entry(name):
        layer = layer_of(name)
        if layer not in stats:
            stats[layer] = LayerStats(layer)
        return stats[layer]

    for i, node in enumerate(graph.nodes):
        row = entry(node.name)
        row.ops += 1
        for shape, dtype, layout in zip(node.out_shapes, node.out_dtypes, layouts[i]):
            if dtype.is_numpy_compatible:
                row.tensor_bytes += (int(np.prod(layout.local_shape(mesh, shape),
                                                 dtype=np.int64)) * dtype.size)
    for collective in lowered.collectives():
        for origin in collective.origins:
            row = entry(origin.op)
            row.collectives += 1
            row.collective_bytes += origin.bytes
    return list(stats.values())


def layer_table(stats) -> list:
    """The rows of the per-layer table (a header, then one row per layer)."""
    return ([("layer", "ops", "collectives", "collective bytes", "tensor bytes")]
            + [(s.layer, s.ops, s.collectives, s.collective_bytes, s.tensor_bytes)
               for s in stats])
