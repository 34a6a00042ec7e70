"""Propagation through regions: the bodies of control-flow ops join the one graph.

A graph with control-flow ops (nodes with regions) is propagated as one flat graph: the
parent's nodes keep their indices, and every region's nodes follow, renumbered (nested
regions after their parent region), as Shardy keeps a while's body in the one module it
propagates. Data-flow edges tie what must share a sharding, each an identity rule (a
"gt.Tie" node: every operand and its one result share their dims' factors):

- a region parameter becomes Tie(operand k): for a While body, Tie(operand k, body
  result k, loop result k), so the loop's operand, body parameter, body result and
  result are one sharding (XLA's "related instructions" of a kWhile);
- If/Case: one more Tie per op result j, of the result and every branch's result j
  (XLA's kConditional: the branches' roots and the op share a sharding).

The Cython core sees ordinary ops; the fixpoint runs across the region boundary in both
directions until stable. See docs/DESIGN_LOG.md, "Partitioned control flow".
"""

from __future__ import annotations

from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.propagation.oprule import OpRule, passing_dims

TIE = "gt.Tie"


def tie_rule(in_shapes, out_shape):
    """Identity rule of a Tie: operands and result share one PASS factor per dim."""
    rule = OpRule()
    dims = passing_dims(rule, out_shape)
    rule.operands = [dims if tuple(shape) == tuple(out_shape) else None
                     for shape in in_shapes]
    rule.results = [dims]
    return rule


class FlatGraph(Graph):
    """A graph and its regions as one Graph for propagation.

    `region_start[i]` lists, for region op i (a flat index), where each of its regions'
    nodes start in the flat graph: region r's node j is flat node region_start[i][r] + j.
    """

    def __init__(self):
        super().__init__()
        self.region_start = {}


def flatten(graph):
    """`graph` itself when it has no regions, else its FlatGraph (see the module)."""
    if not any(node.regions for node in graph.nodes):
        return graph
    flat = flat_copy(graph)
    _add_regions(flat, graph.nodes, 0)
    return flat


def flat_copy(graph) -> FlatGraph:
    """A FlatGraph holding `graph`'s nodes (the same Node objects), inputs, outputs,
    captures, aliases and annotations, for propagation to append nodes to."""
    flat = FlatGraph()
    for node in graph.nodes:
        flat.add(node)
    flat.inputs, flat.outputs = list(graph.inputs), list(graph.outputs)
    flat.captures, flat.aliases = list(graph.captures), dict(graph.aliases)
    flat.annotations = dict(graph.annotations)
    return flat


def _add_regions(flat, nodes, offset):
    """Append the regions of every region op among `nodes`, flat nodes offset.. (their
    inputs already flat indices)."""
    for j, node in enumerate(nodes):
        if not node.regions:
            continue
        i = offset + j
        operands = node.region_operands()
        loop = "While" in node.op
        starts = []
        body = node.regions[-1]
        body_start = len(flat.nodes) + sum(len(r.nodes) for r in node.regions[:-1])
        for region in node.regions:
            start = len(flat.nodes)
            starts.append(start)
            params = {ref.node: k for k, ref in enumerate(region.inputs)}
            for index, n in enumerate(region.nodes):
                k = params.get(index)
                if k is None:
                    copy = Node(n.name, n.op, [_shift(r, start) for r in n.inputs], n.attrs,
                                n.out_shapes, n.out_dtypes,
                                [c + start for c in n.control_inputs], n.params, n.regions)
                else:
                    ties = [operands[k]]
                    if loop:  # body result k and loop result k share the parameter's
                        ties += [_shift(body.outputs[k], body_start), Ref(i, k)]
                    copy = Node(n.name, TIE, ties, out_shapes=n.out_shapes,
                                out_dtypes=n.out_dtypes)
                flat.add(copy)
            for ref, proto in region.annotations.items():
                flat.annotations[_shift(ref, start)] = proto
            flat.aliases.update({name: _shift(ref, start)
                                 for name, ref in region.aliases.items()})
        flat.region_start[i] = starts
        if not loop:  # a branch op's result j is every branch's result j
            for k, (shape, dtype) in enumerate(zip(node.out_shapes, node.out_dtypes)):
                ties = [Ref(i, k)] + [_shift(region.outputs[k], start)
                                      for region, start in zip(node.regions, starts)]
                flat.add(Node(f"{node.name}/tie_{k}", TIE, ties, out_shapes=[shape],
                              out_dtypes=[dtype]))
        for region, start in zip(node.regions, starts):
            _add_regions(flat, flat.nodes[start:start + len(region.nodes)], start)


def _shift(ref, offset):
    return Ref(ref.node + offset, ref.out)


class RegionPropagation:
    """The propagation of one region, read from the propagation of the flat graph: the
    same `layouts[index]`, `rules[index]` and `region(index, r)` as a Propagation, for
    the region's own node indices."""

    def __init__(self, propagation, start):
        self._propagation = propagation
        self._start = start
        self.layouts = _Shifted(propagation.layouts, start)
        self.rules = _Shifted(propagation.rules, start)

    def layout(self, ref):
        """Layout of the region's tensor `ref`."""
        return self.layouts[ref.node][ref.out]

    def region(self, index, r):
        """The propagation of region r of this region's node `index`."""
        return self._propagation.region(self._start + index, r)

    def origin(self, ref):
        """The Origins of the region's tensor `ref` (see Propagation.origin; the names
        in them are the flat graph's)."""
        return self._propagation.origin(_shift(ref, self._start))


class _Shifted:
    def __init__(self, items, start):
        self._items, self._start = items, start

    def __getitem__(self, index):
        return self._items[self._start + index]

