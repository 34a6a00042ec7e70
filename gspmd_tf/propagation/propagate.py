"""Propagation driver: encode the graph and its rules as arrays, run the Cython core.

Priority, highest first: (1) user annotations are fixed and never changed; (2) rules
extend every other tensor, one op at a time, adding mesh axes to dims but never removing
them: an op gives each of its factors the most-split candidate its tensors offer, and
a tensor dim takes its factors' axes when its current axes are a prefix of them.
Sweeps alternate forward and backward over the graph until nothing changes. Tensors left
without axes are replicated.
"""

from __future__ import annotations

import gc

import numpy as np

from gspmd_tf import _encode, _propagation
from gspmd_tf.layout import Layout
from gspmd_tf.registry import has_rule, rule_for

# the core's limits (csrc/propagation.pyx): axes per dim, factors per op
MAX_AXES = 4
MAX_FACTORS = 64


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
    """Result: a Layout per tensor (layouts[node][out]) and the rule of every node."""

    def __init__(self, layouts, rules, sweeps):
        self.layouts = layouts
        self.rules = rules
        self.sweeps = sweeps

    def layout(self, ref):
        """Layout of tensor `ref`."""
        return self.layouts[ref.node][ref.out]


def propagate(graph, mesh, seeds):
    """Give every tensor of `graph` a Layout on `mesh`.

    `seeds` maps Refs to the Layouts users asked for; those are fixed. Returns a
    Propagation with the layouts and the OpRule of every node (None: no rule).
    """
    encoded = encode(graph, mesh, seeds)
    sweeps = run(encoded)
    return decode(graph, mesh, encoded, sweeps)


class Encoded:
    """The graph, its rules and seeds as the core's flat arrays (see
    csrc/propagation.pyx for their meaning); `rules` holds each node's OpRule."""

    def __init__(self, rules, tensor_base, dim_start, axes, naxes, core_args):
        self.rules = rules
        self.tensor_base = tensor_base
        self.dim_start = dim_start
        self.axes = axes
        self.naxes = naxes
        self.core_args = core_args


def encode(graph, mesh, seeds):
    """Encode `graph`, its rules and the fixed `seeds` for the core."""
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the encoder allocates a few objects per op; collections would dominate
    try:
        (rules, rank, tensor_base, slot_tensor, dim_factors, dim_counts, factor_size,
         factor_kind, op_slots, op_factors, tensor_op_start,
         tensor_ops) = _encode.encode_rules(
            graph.nodes, has_rule, lambda i: rule_for(graph, graph.nodes[i]),
            MAX_FACTORS)
    finally:
        if gc_was_enabled:
            gc.enable()
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
    core_args = (rank, dim_start[:-1].copy(), fixed, axes, naxes,
                 np.asarray(mesh.shape, np.int32), _offsets(op_slots), _offsets(op_factors),
                 slot_tensor, _offsets(rank[slot_tensor]), _offsets(dim_counts), dim_factors,
                 factor_size, factor_kind, tensor_op_start, tensor_ops)
    return Encoded(rules, base, dim_start.tolist(), axes, naxes, core_args)


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
    """The Propagation of an encoded graph after `run` (layouts decoded lazily)."""
    layouts = _LazyLayouts(graph, mesh.axis_names, encoded.tensor_base, encoded.dim_start,
                           encoded.axes, encoded.naxes.tolist())
    return Propagation(layouts, encoded.rules, sweeps)
