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

import gc
import logging
from dataclasses import dataclass

import numpy as np

from gspmd_tf import _encode, _propagation
from gspmd_tf.graph.ir import Ref
from gspmd_tf.layout import Layout
from gspmd_tf.propagation.rules import RULES, rule_for

log = logging.getLogger("gspmd_tf")

# the core's limits (csrc/propagation.pyx): axes per dim, factors per op
MAX_AXES = 4
MAX_FACTORS = 64
# the priority layers, in the order they run (ids as csrc/encode.pyx assigns them)
LAYERS = ("pass-through", "all ops", "broadcast")


class _LazyLayouts:
    """layouts[node][out] decoded from the core's arrays on first use."""

    def __init__(self, graph, names, tensor_base, dim_start, axes, naxes):
        self._graph, self._names = graph, names
        self._base, self._dim_start, self._axes, self._naxes = tensor_base, dim_start, axes, naxes
        self._cache = {}

    def __len__(self):
        return len(self._graph.nodes)

    def __getitem__(self, index):
        if index not in self._cache:
            outs = []
            for k in range(len(self._graph.nodes[index].out_shapes)):
                t = self._base[index] + k
                rows = range(self._dim_start[t], self._dim_start[t + 1])
                outs.append(Layout(tuple(
                    tuple(self._names[a] for a in self._axes[r, :self._naxes[r]])
                    for r in rows)))
            self._cache[index] = outs
        return self._cache[index]


class Propagation:
    """Result: a Layout per tensor (layouts[node][out]), the rule of every node, and
    where each tensor's sharding came from (origin)."""

    def __init__(self, layouts, rules, sweeps, origins):
        self.layouts = layouts
        self.rules = rules
        self.sweeps = sweeps
        self._origins = origins

    def layout(self, ref):
        """Layout of tensor `ref`."""
        return self.layouts[ref.node][ref.out]

    def origin(self, tensor):
        """Where the sharding of `tensor` (a Ref, or a name "op" / "op:k") came from: an
        Origin per mesh axis splitting one of its dims, in dim order (empty when the
        tensor is replicated)."""
        return self._origins.of(tensor)


def propagate(graph, mesh, seeds, layered=True):
    """Give every tensor of `graph` a Layout on `mesh`.

    `seeds` maps Refs to the Layouts users asked for; those are fixed. With `layered`
    False all ops take part from the start, in one layer (for comparison). Returns a
    Propagation with the layouts, the OpRule of every node (None: no rule) and origins.
    """
    encoded = encode(graph, mesh, seeds, layered)
    sweeps = run(encoded)
    return decode(graph, mesh, encoded, sweeps)


class Encoded:
    """The graph, its rules and seeds as the core's flat arrays (see
    csrc/propagation.pyx for their meaning); `rules` holds each node's OpRule,
    `op_node` the node of each core op."""

    def __init__(self, rules, tensor_base, dim_start, axes, naxes, op_node, core_args):
        self.rules = rules
        self.tensor_base = tensor_base
        self.dim_start = dim_start
        self.axes = axes
        self.naxes = naxes
        self.op_node = op_node
        self.core_args = core_args


def encode(graph, mesh, seeds, layered=True):
    """Encode `graph`, its rules and the fixed `seeds` for the core (one layer for all
    ops unless `layered`)."""
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the encoder allocates a few objects per op; collections would dominate
    try:
        (rules, rank, tensor_base, slot_tensor, dim_factors, dim_counts, factor_size,
         factor_kind, op_slots, op_factors, tensor_op_start, tensor_ops, slot_layer,
         op_node) = _encode.encode_rules(
            graph.nodes, RULES.__contains__, lambda i: rule_for(graph, graph.nodes[i]),
            MAX_FACTORS)
    finally:
        if gc_was_enabled:
            gc.enable()
    if not layered:
        slot_layer[:] = 0
    base = tensor_base.tolist()
    dim_start = _offsets(rank)
    axes = np.full((max(int(dim_start[-1]), 1), MAX_AXES), -1, np.int8)
    naxes = np.zeros(len(axes), np.int8)
    fixed = np.zeros(len(rank), np.uint8)
    axis_id = {name: i for i, name in enumerate(mesh.axis_names)}
    for ref, layout in seeds.items():
        t = base[ref.node] + ref.out
        for d, names in enumerate(layout.dims):
            axes[dim_start[t] + d, :len(names)] = [axis_id[n] for n in names]
            naxes[dim_start[t] + d] = len(names)
        fixed[t] = 1
        _warn_size1_splits(graph, ref, layout)
    core_args = (rank, dim_start[:-1].copy(), fixed, axes, naxes,
                 np.asarray(mesh.shape, np.int32), _offsets(op_slots), _offsets(op_factors),
                 slot_tensor, _offsets(rank[slot_tensor]), _offsets(dim_counts), dim_factors,
                 factor_size, factor_kind, tensor_op_start, tensor_ops, slot_layer,
                 len(LAYERS) if layered else 1, np.full(axes.shape, -1, np.int32),
                 np.full(axes.shape, -1, np.int8))
    return Encoded(rules, base, dim_start.tolist(), axes, naxes, op_node, core_args)


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
    return _propagation.propagate_arrays(*encoded.core_args)


def decode(graph, mesh, encoded, sweeps):
    """The Propagation of an encoded graph after `run` (layouts and origins decoded
    lazily)."""
    layouts = _LazyLayouts(graph, mesh.axis_names, encoded.tensor_base, encoded.dim_start,
                           encoded.axes, encoded.naxes.tolist())
    return Propagation(layouts, encoded.rules, sweeps, _Origins(graph, mesh, encoded))


@dataclass(frozen=True)
class Hop:
    """One op a mesh axis went through: `tensor` took it from `source` at op `op` (a
    node name), `direction` "forward" (into a result) or "backward" (into an operand),
    in priority layer `layer` (one of LAYERS)."""

    source: str
    op: str
    op_type: str
    direction: str
    layer: str
    tensor: str


@dataclass(frozen=True)
class Origin:
    """Why dim `dim` of `tensor` is split over mesh axis `axis`: the user sharding of
    tensor `seed` (`seed_kind`: "argument 0", "annotation", "out_shardings[0]",
    "captured variable" or "user sharding") and the hops that carried it here, seed
    first (none when `tensor` is the seed)."""

    tensor: str
    dim: int
    axis: str
    seed: str
    seed_kind: str
    hops: tuple

    def __str__(self):
        path = "".join(f" -> {h.op_type} {h.op!r} ({h.direction}, {h.layer}) -> {h.tensor!r}"
                       for h in self.hops)
        return (f"dim {self.dim} of {self.tensor!r} split over {self.axis!r}: "
                f"{self.seed_kind} {self.seed!r}{path}")


class _Origins:
    """Decodes the core's origin arrays on demand (nothing is done for tensors nobody
    asks about)."""

    def __init__(self, graph, mesh, encoded):
        (_, _, self._fixed, self._axes, self._naxes, _, self._slot_start, _,
         self._slot_tensor, *_, self._origin_slot, self._origin_layer) = encoded.core_args
        self._graph, self._names = graph, mesh.axis_names
        self._base = np.asarray(encoded.tensor_base, np.int64)
        self._dim_start, self._op_node = encoded.dim_start, encoded.op_node
        self._seed_kinds = None

    def of(self, tensor):
        """The Origins of `tensor` (a Ref or a name)."""
        graph = self._graph
        ref = graph.ref(tensor) if isinstance(tensor, str) else tensor
        t = self._tensor(ref)
        origins = []
        for d, row in enumerate(range(self._dim_start[t], self._dim_start[t + 1])):
            for k in range(self._naxes[row]):
                origins.append(self._trace(t, d, int(self._axes[row, k])))
        return tuple(origins)

    def _trace(self, t, dim, axis):
        """Follow mesh axis `axis` of tensor t back to the seed it came from."""
        graph, hops, target = self._graph, [], t
        while not self._fixed[t]:
            row, k = self._find(t, axis)
            slot = int(self._origin_slot[row, k])
            op = int(np.searchsorted(self._slot_start, slot, side="right")) - 1
            node = int(self._op_node[op])
            source = int(self._slot_tensor[slot])
            ref = self._ref(t)
            hops.append(Hop(graph.tensor_name(self._ref(source)), graph.nodes[node].name,
                            graph.nodes[node].op,
                            "forward" if ref.node == node else "backward",
                            LAYERS[self._origin_layer[row, k]], graph.tensor_name(ref)))
            t = source
        seed = self._ref(t)
        return Origin(graph.tensor_name(self._ref(target)), dim, self._names[axis],
                      graph.tensor_name(seed), self._kind_of(seed), tuple(reversed(hops)))

    def _find(self, t, axis):
        """The dim row and position of mesh axis `axis` in tensor t."""
        for row in range(self._dim_start[t], self._dim_start[t + 1]):
            for k in range(self._naxes[row]):
                if self._axes[row, k] == axis:
                    return row, k
        raise AssertionError(f"tensor {t} lost axis {axis}")  # axes are only appended

    def _tensor(self, ref):
        return int(self._base[ref.node]) + ref.out

    def _ref(self, t):
        node = int(np.searchsorted(self._base, t, side="right")) - 1
        return Ref(node, t - int(self._base[node]))

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
