"""Propagation driver: encode the graph and its rules as arrays, run the Cython core.

Priority, highest first: (1) user annotations are fixed and never changed; (2) rules
extend every other tensor, one op at a time, adding mesh axes to dims but never removing
them: an op gives each of its factors the most-split candidate its tensors offer, and
a tensor dim takes its factors' axes when its current axes are a prefix of them.
Sweeps alternate forward and backward over the graph until nothing changes. (3) This
runs in priority layers (LAYERS), each to its fixed point before the next: pass-through
ops first, then all ops, then broadcasting operands, as XLA's aggressiveness levels.
Tensors left without axes are replicated. Every propagated axis remembers where it came
from (Propagation.origin).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from gspmd_tf import _encode, _propagation
from gspmd_tf.gc_pause import gc_paused
from gspmd_tf.graph.ir import Graph, Ref
from gspmd_tf.layout import Layout, merged_axes, merged_layout, overlap
from gspmd_tf.mesh import Mesh
from gspmd_tf.propagation.oprule import OpRule
from gspmd_tf.propagation.knobs import Knobs, barrier_slots, rounds, tie_groups
from gspmd_tf.propagation.regions import TIE, RegionPropagation, flatten, tie_rule
from gspmd_tf.propagation.sub_axes import AxisView, axis_view
from gspmd_tf.registry import has_rule, rule_for
from gspmd_tf.sharding import Sharding

log = logging.getLogger("gspmd_tf")

# the core's limit (csrc/propagation.pyx): axes per dim (an op may have any number of
# factors)
MAX_AXES = 4
# the priority layers, in the order they run (ids as csrc/encode.pyx assigns them)
LAYERS = ("pass-through", "all ops", "broadcast")


class _LazyLayouts:
    """layouts[node][out] decoded from the core's arrays on first use."""

    def __init__(self, graph, names, tensor_base, dim_start, axes, naxes):
        self._graph, self._names = graph, names
        self._arrays = (tensor_base, dim_start, naxes, axes)
        self._lists = None  # the arrays as lists (faster to index), made on first use
        self._cache = {}
        # one Layout object per distinct dims: repeated layers share a few, and the
        # partitioner's comparisons of shared objects are quick
        self._interned = {}

    def __len__(self):
        return len(self._graph.nodes)

    def __getitem__(self, index):
        if index not in self._cache:
            if self._lists is None:
                self._lists = ([a.tolist() for a in self._arrays]
                               + [_row_codes(*self._arrays[2:])])
            base, dim_start, naxes, axes, codes = self._lists
            outs = []
            interned = self._interned
            for k in range(len(self._graph.nodes[index].out_shapes)):
                t = base[index] + k
                start, stop = dim_start[t], dim_start[t + 1]
                # a tensor's dims rows as a tuple of ints: one C-level slice to look up
                key = tuple(codes[start:stop])
                layout = interned.get(key)
                if layout is None:
                    names = self._names
                    layout = interned[key] = merged_layout(Layout(tuple(
                        tuple(names[a] for a in axes[r][:naxes[r]]) if naxes[r] else ()
                        for r in range(start, stop))))
                outs.append(layout)
            self._cache[index] = outs
        return self._cache[index]


def _row_codes(naxes, axes):
    """One int per dim row of the core's arrays, equal for rows split over the same
    mesh axes in the same order (axis ids + 1 as base-256 digits; unused slots 0)."""
    used = np.arange(axes.shape[1]) < naxes[:, None]
    digits = np.where(used, axes.astype(np.int64) + 1, 0)
    return (digits * (256 ** np.arange(axes.shape[1], dtype=np.int64))).sum(axis=1).tolist()


class Propagation:
    """Result: a Layout per tensor (layouts[node][out]), the rule of every node, and
    where each tensor's sharding came from (origin)."""

    def __init__(self, layouts: Sequence[Sequence[Layout]], rules: list[Optional[OpRule]],
                 sweeps: int, origins: "_Origins", region_start: Optional[dict] = None):
        self.layouts = layouts
        self.rules = rules
        self.sweeps = sweeps
        self._origins = origins
        self._region_start = region_start or {}

    def region(self, index: int, r: int) -> RegionPropagation:
        """The propagation (a RegionPropagation) of region r of control-flow node
        `index`: its nodes' layouts and rules, by the region's own node indices."""
        return RegionPropagation(self, self._region_start[index][r])

    def layout(self, ref: Ref) -> Layout:
        """Layout of tensor `ref`."""
        return self.layouts[ref.node][ref.out]

    def origin(self, tensor) -> list:
        """Where the sharding of `tensor` (a Ref, or a name "op" / "op:k") came from: an
        Origin per mesh axis splitting one of its dims, in dim order (empty when the
        tensor is replicated)."""
        return self._origins.of(tensor)


def propagate(graph: Graph, mesh: Mesh, seeds: dict[Ref, Layout],
              layered: bool = True, knobs: Optional[Knobs] = None) -> Propagation:
    """Give every tensor of `graph` a Layout on `mesh`.

    `seeds` maps Refs to the Layouts users asked for; those are fixed. `knobs` holds
    Shardy's user priorities, sharding groups and propagation barriers
    (propagation/knobs.py). With `layered`
    False all ops take part from the start, in one layer (for comparison). Returns a
    Propagation with the layouts, the OpRule of every node (None: no rule) and origins.
    The regions of control-flow ops are propagated with the graph (propagation/regions.py;
    Propagation.region gives theirs), annotations inside them seeding like any other.
    """
    flat = flatten(graph)
    if flat is not graph:
        seeds = dict(seeds)
        for ref, proto in flat.annotations.items():
            if ref.node >= len(graph.nodes):
                seeds[ref] = _annotation_layout(flat, mesh, ref, proto)
    knobs = knobs or Knobs()
    flat = tie_groups(flat, knobs.groups)
    view = axis_view(flat, mesh, seeds, MAX_AXES)
    encoded, sweeps = None, 0
    for round_seeds in rounds(seeds, knobs.priorities) or [seeds]:
        round_seeds = {ref: view.cut(layout) for ref, layout in round_seeds.items()}
        before, encoded = encoded, encode(flat, view, round_seeds, layered, knobs.open_dims)
        if before is not None:
            _carry(before, encoded)
        encoded.no_write = barrier_slots(encoded.op_node, encoded.core_args[6],
                                         knobs.barriers)
        sweeps += run(encoded)
    return decode(flat, view, encoded, sweeps)


def _carry(before, encoded):
    """Start the tensors `encoded` does not fix from what the earlier round `before`
    gave them (axes and their origins): user priorities (propagation/knobs.py)."""
    rank, _, fixed, axes, naxes, *_, origin_slot, origin_layer = encoded.core_args
    free = np.repeat(~encoded.seeded, rank)  # one entry per dim row
    rows = len(free)  # (the arrays keep one row when there is none)
    for now, then in zip((axes, naxes, origin_slot, origin_layer),
                         (before.core_args[k] for k in (3, 4, -2, -1))):
        now[:rows][free] = then[:rows][free]


def _annotation_layout(graph, mesh, ref, proto):
    """The Layout of a gt.mesh_split / xla_sharding annotation on tensor `ref` (with its
    tiles, where no layout of the mesh places them in its device order: see
    lowering.seed_annotations)."""
    tensor = graph.tensor_name(ref)
    return Sharding.from_proto(proto).placement(mesh, len(graph.shape(ref)),
                                                f"tensor {tensor!r}").layout


def _has_rule(op_type):
    return op_type == TIE or has_rule(op_type)


def _rule_for(graph, node):
    if node.op == TIE:
        return tie_rule([graph.shape(r) for r in node.inputs], node.out_shapes[0])
    return rule_for(graph, node)


class Encoded:
    """The graph, its rules and seeds as the core's flat arrays (see
    csrc/propagation.pyx for their meaning); `rules` holds each node's OpRule,
    `op_node` the node of each core op, `tensor_base` the first tensor id of each node,
    `dim_start` the first dim row of each tensor (one more entry than tensors)."""

    def __init__(self, rules, tensor_base, dim_start, axes, naxes, op_node, core_args):
        self.rules = rules
        self.tensor_base = tensor_base
        self.dim_start = dim_start
        self.axes = axes
        self.naxes = naxes
        self.op_node = op_node
        self.core_args = core_args
        self.no_write = None  # the barriers' closed slots (knobs.barrier_slots)
        self.closed = None  # the dims of open-dim seeds never extended (encode)
        self.seeded = None  # per tensor: a seed


def encode(graph, mesh: Mesh | AxisView, seeds, layered=True, open_dims=None):
    """Encode `graph`, its rules and the fixed `seeds` for the core (one layer for all
    ops unless `layered`), on the axes of `mesh` (a Mesh, or an AxisView whose axes the
    seeds name). A seed with `open_dims` ({Ref: dims}) is not fixed: its
    other dims are closed (never extended), its open ones start from its axes (their
    origin marked -1: the seed's own) and may take more (propagation/knobs.py)."""
    with gc_paused():  # the encoder allocates a few objects per op
        (rules, rank, tensor_base, slot_tensor, dim_factors, dim_counts, dim_uneven,
         factor_size, factor_kind, op_slots, op_factors, tensor_op_start, tensor_ops,
         slot_layer, op_node) = _encode.encode_rules(
            graph.nodes, _has_rule, lambda i: _rule_for(graph, graph.nodes[i]))
    if not layered:
        slot_layer[:] = 0
    dim_start = _offsets(rank)
    axes = np.full((max(int(dim_start[-1]), 1), MAX_AXES), -1, np.int8)
    naxes = np.zeros(len(axes), np.int8)
    fixed = np.zeros(len(rank), np.uint8)
    seeded = np.zeros(len(rank), bool)
    closed = np.zeros(len(axes), np.uint8)
    origin_slot = np.empty(axes.shape, np.int32)
    axis_id = {name: i for i, name in enumerate(mesh.axis_names)}
    for ref, layout in seeds.items():
        t = int(tensor_base[ref.node]) + ref.out
        opened = (open_dims or {}).get(ref, ())
        for d, names in enumerate(layout.dims):
            axes[dim_start[t] + d, :len(names)] = [axis_id[n] for n in names]
            naxes[dim_start[t] + d] = len(names)
            closed[dim_start[t] + d] = d not in opened
            origin_slot[dim_start[t] + d] = -1
        fixed[t], seeded[t] = not opened, True
        _warn_size1_splits(graph, ref, layout)
    core_args = (rank, dim_start[:-1].copy(), fixed, axes, naxes,
                 np.asarray(mesh.shape, np.int32), _offsets(op_slots), _offsets(op_factors),
                 slot_tensor, _offsets(rank[slot_tensor]), _offsets(dim_counts), dim_factors,
                 dim_uneven, factor_size, factor_kind, tensor_op_start, tensor_ops, slot_layer,
                 len(LAYERS) if layered else 1,
                 # origins: written by the core for every axis it appends, read for those only
                 origin_slot, np.empty(axes.shape, np.int8))
    encoded = Encoded(rules, tensor_base, dim_start, axes, naxes, op_node, core_args)
    encoded.seeded = seeded
    encoded.closed = closed if open_dims else None
    return encoded


def _warn_size1_splits(graph, ref, layout):
    """Say so when a user sharding splits a size-1 dim. The tensor keeps the split
    exactly (as XLA does: one device holds the element, the others padding), but rules
    give size-1 dims no factor, so no other tensor inherits it."""
    shape = graph.shape(ref)
    for d, names in enumerate(layout.dims):
        if names and shape[d] == 1:
            log.warning(
                "gspmd_tf: tensor %r: dim %d has size 1 but its sharding splits it over "
                "mesh axis %s; the tensor keeps this split (one device holds the element, "
                "the others padding), but propagation does not carry a split of a size-1 "
                "dim to other tensors; leave the dim unsplit (None) to avoid a reshard "
                "there", graph.tensor_name(ref), d, " and ".join(repr(n) for n in names))


def _offsets(counts):
    """int32 start offsets of consecutive runs of `counts` (one more than counts)."""
    out = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=out[1:])
    return out


def run(encoded):
    """Run the Cython fixpoint on `encoded` (its axes are extended in place); returns
    the number of sweeps."""
    return _propagation.propagate_arrays(*encoded.core_args, no_write=encoded.no_write,
                                         closed=encoded.closed)


def decode(graph, mesh: Mesh | AxisView, encoded, sweeps):
    """The Propagation of an encoded graph after `run` (layouts and origins decoded
    lazily, sub-axes that make up an axis merged back into it)."""
    layouts = _LazyLayouts(graph, mesh.axis_names, encoded.tensor_base, encoded.dim_start,
                           encoded.axes, encoded.naxes)
    return Propagation(layouts, encoded.rules, sweeps, _Origins(graph, mesh, encoded),
                       getattr(graph, "region_start", None))


@dataclass(frozen=True)
class Hop:
    """One op a mesh axis went through: `tensor` took it from `source` at op `op` (a
    node name), `direction` "forward" (into a result) or "backward" (into an operand),
    while priority layer `layer` ran (one of LAYERS)."""

    source: str
    op: str
    op_type: str
    direction: str
    layer: str
    tensor: str


class Origin:
    """Why dim `dim` of `tensor` is split over mesh axis `axis`: the user sharding of
    tensor `seed` (`seed_kind`: "argument 0", "annotation", "out_shardings[0]",
    "captured variable" or "user sharding") and the `hops` (Hop records) that carried
    it here, seed first (none when `tensor` is the seed). The hops are decoded on first
    use: a chain may run the length of the graph."""

    __slots__ = ("tensor", "dim", "axis", "seed", "seed_kind", "num_hops", "_decode", "_hops")

    def __init__(self, tensor, dim, axis, seed, seed_kind, num_hops, decode_hops):
        self.tensor, self.dim, self.axis = tensor, dim, axis
        self.seed, self.seed_kind, self.num_hops = seed, seed_kind, num_hops
        self._decode, self._hops = decode_hops, None

    @property
    def hops(self):
        """The Hops from the seed to the tensor (a tuple)."""
        if self._hops is None:
            self._hops = self._decode()
        return self._hops

    def __str__(self):
        """One line, e.g. dim 1 of 'relu' split over 'model': argument 1 'w1' -> MatMul 'h'
        (forward, all ops) -> 'h' -> Relu 'relu' (forward, all ops) -> 'relu'; a long
        chain shows its first and last three hops."""
        hops = list(self.hops)
        if len(hops) > 6:
            hops = hops[:3] + [f" -> ... {len(hops) - 6} more hops ..."] + hops[-3:]
        path = "".join(h if isinstance(h, str) else
                       f" -> {h.op_type} {h.op!r} ({h.direction}, {h.layer}) -> {h.tensor!r}"
                       for h in hops)
        return (f"dim {self.dim} of {self.tensor!r} split over {self.axis!r}: "
                f"{self.seed_kind} {self.seed!r}{path}")

    def __repr__(self):
        return f"<Origin {self}>"


def _merged_origins(origins):
    """A dim's Origins with each run of sub-axes that merged_axes merges as one Origin
    (its first part's, naming the merged axis)."""
    out, i = [], 0
    for axis in merged_axes(tuple(o.axis for o in origins)):
        first, i = origins[i], i + 1
        while i < len(origins) and overlap(axis, origins[i].axis):  # its other parts
            i += 1
        first.axis = axis
        out.append(first)
    return out


class _Origins:
    """Decodes the core's origin arrays on demand (nothing is done for tensors nobody
    asks about)."""

    def __init__(self, graph, mesh, encoded):
        (self._rank, self._dim_start, self._fixed, self._axes, self._naxes, _,
         self._slot_start, _, self._slot_tensor, *_, self._origin_slot,
         self._origin_layer) = encoded.core_args
        self._graph, self._names = graph, mesh.axis_names
        self._base, self._op_node = encoded.tensor_base, encoded.op_node
        self._seed_kinds = None

    def of(self, tensor):
        """The Origins of `tensor` (a Ref or a name)."""
        ref = self._graph.ref(tensor) if isinstance(tensor, str) else tensor
        t = int(self._base[ref.node]) + ref.out
        start = self._dim_start[t]
        return tuple(o for row in range(start, start + self._rank[t])
                     for o in _merged_origins([self._trace(t, int(self._axes[row, k]))
                                               for k in range(self._naxes[row])]))

    def _trace(self, t, axis):
        """The Origin of mesh axis `axis` of tensor t."""
        tensors, dims, slots, layers = _propagation.trace_axis(
            t, axis, self._fixed, self._rank, self._dim_start, self._axes, self._naxes,
            self._origin_slot, self._origin_layer, self._slot_tensor)
        name = self._graph.tensor_name
        seed = self._ref(tensors[-1:])[0]
        return Origin(name(self._ref(tensors[:1])[0]), int(dims[0]), self._names[axis],
                      name(seed), self._kind_of(seed), len(tensors) - 1,
                      lambda: self._hops(tensors, slots, layers))

    def _hops(self, tensors, slots, layers):
        """Hop records from the walk of trace_axis (reversed: seed first)."""
        graph = self._graph
        nodes = graph.nodes
        ops = np.searchsorted(self._slot_start, slots[:-1], side="right") - 1
        op_nodes = self._op_node[ops].tolist()
        refs = self._ref(tensors)
        names = [graph.tensor_name(ref) for ref in refs]
        return tuple(
            Hop(names[i + 1], nodes[op_nodes[i]].name, nodes[op_nodes[i]].op,
                "forward" if refs[i].node == op_nodes[i] else "backward",
                LAYERS[layers[i]], names[i])
            for i in reversed(range(len(op_nodes))))

    def _ref(self, tensors):
        """Refs of an array of tensor ids."""
        nodes = np.searchsorted(self._base, tensors, side="right") - 1
        return [Ref(n, o) for n, o in zip(nodes.tolist(), (tensors - self._base[nodes]).tolist())]

    def _kind_of(self, ref):
        """What kind of user sharding the seed `ref` is."""
        if self._seed_kinds is None:
            graph, kinds = self._graph, {}
            first_capture = len(graph.inputs) - len(graph.captures)
            for j, out in enumerate(graph.outputs):
                kinds[out] = f"out_shardings[{j}]"
            for i, arg in enumerate(graph.inputs):
                kinds[arg] = "captured variable" if i >= first_capture else f"argument {i}"
            for annotated in graph.annotations:
                kinds[annotated] = "annotation"
            self._seed_kinds = kinds
        return self._seed_kinds.get(ref, "user sharding")
