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

from gspmd_tf import _propagation
from gspmd_tf.layout import Layout
from gspmd_tf.propagation.rules import RULES, rule_for

MAX_AXES = 4
MAX_FACTORS = 64


class _Encoded:
    """An OpRule flattened once for every node that shares it (see the core's docstring):
    which inputs/outputs take part, the factor ids of each of their dims, factor data."""

    __slots__ = ("rule", "inputs", "outputs", "dim_factors", "dim_counts", "sizes", "kinds")

    def __init__(self, rule):
        self.rule = rule
        self.inputs = [i for i, dims in enumerate(rule.operands) if dims is not None]
        self.outputs = [k for k, dims in enumerate(rule.results) if dims is not None]
        dims_lists = [rule.operands[i] for i in self.inputs] + \
            [rule.results[k] for k in self.outputs]
        self.dim_factors = [f for dims in dims_lists for fs in dims for f in fs]
        self.dim_counts = [len(fs) for dims in dims_lists for fs in dims]
        self.sizes = rule.factor_sizes
        self.kinds = rule.factor_kinds


def _rule_key(nodes, node, const_bytes):
    """What a rule may depend on: op type, shapes, attrs and constant inputs (whose
    serialized values `const_bytes` caches by node index)."""
    parts = []
    for ref in node.inputs:
        src = nodes[ref.node]
        parts.append(src.out_shapes[ref.out])
        if src.op == "Const":
            value = const_bytes.get(ref.node)
            if value is None:
                value = const_bytes[ref.node] = src.attrs["value"].SerializeToString()
            parts.append(value)
    attrs = tuple((k, v.SerializeToString()) for k, v in node.attrs.items())
    return node.op, tuple(parts), tuple(node.out_shapes), attrs


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
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the encoder allocates a few objects per op; collections would dominate
    try:
        return _propagate(graph, mesh, seeds)
    finally:
        if gc_was_enabled:
            gc.enable()


def _propagate(graph, mesh, seeds):
    nodes = graph.nodes
    out_counts = np.fromiter((len(n.out_shapes) for n in nodes), np.int64, len(nodes))
    tensor_base = np.zeros(len(nodes) + 1, np.int64)
    np.cumsum(out_counts, out=tensor_base[1:])
    base = tensor_base.tolist()
    rank = np.fromiter((len(s) for n in nodes for s in n.out_shapes), np.int32,
                       int(tensor_base[-1]))
    dim_start = np.zeros(len(rank) + 1, np.int32)
    np.cumsum(rank, out=dim_start[1:])
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

    cache, rules, const_bytes = {}, [], {}
    slot_tensor, slot_op, dim_factors, dim_counts = [], [], [], []
    factor_size, factor_kind, op_slots, op_factors = [], [], [], []
    for index, node in enumerate(nodes):
        if node.op not in RULES:
            rules.append(None)
            continue
        key = _rule_key(nodes, node, const_bytes)
        enc = cache.get(key)
        if enc is None:
            rule = rule_for(graph, node)
            enc = cache[key] = None if rule is None or \
                len(rule.factor_sizes) > MAX_FACTORS else _Encoded(rule)
        rules.append(enc and enc.rule)
        if enc is None:
            continue
        op = len(op_slots)
        inputs = node.inputs
        tensors = [base[inputs[i].node] + inputs[i].out for i in enc.inputs]
        tensors += [base[index] + k for k in enc.outputs]
        slot_tensor += tensors
        slot_op += [op] * len(tensors)
        dim_factors += enc.dim_factors
        dim_counts += enc.dim_counts
        factor_size += enc.sizes
        factor_kind += enc.kinds
        op_slots.append(len(tensors))
        op_factors.append(len(enc.sizes))

    i32 = lambda a: np.asarray(a, np.int32)
    slot_tensor, slot_op = i32(slot_tensor), i32(slot_op)
    slot_start = np.zeros(len(op_slots) + 1, np.int32)
    np.cumsum(op_slots, out=slot_start[1:])
    factor_start = np.zeros(len(op_factors) + 1, np.int32)
    np.cumsum(op_factors, out=factor_start[1:])
    slot_dim_start = np.zeros(len(slot_tensor) + 1, np.int32)
    np.cumsum(rank[slot_tensor], out=slot_dim_start[1:])
    dim_factor_start = np.zeros(len(dim_counts) + 1, np.int32)
    np.cumsum(dim_counts, out=dim_factor_start[1:])
    # the ops that read or write each tensor, grouped by tensor
    order = np.argsort(slot_tensor, kind="stable")
    tensor_ops = slot_op[order]
    tensor_op_start = np.searchsorted(slot_tensor[order], np.arange(len(rank) + 1)).astype(np.int32)
    sweeps = _propagation.propagate_arrays(
        rank, dim_start[:-1].copy(), fixed, axes, naxes, i32(mesh.shape), slot_start,
        factor_start, slot_tensor, slot_dim_start, dim_factor_start, i32(dim_factors),
        np.asarray(factor_size, np.int64), np.asarray(factor_kind, np.int8), tensor_op_start, tensor_ops)
    layouts = _LazyLayouts(graph, mesh.axis_names, base, dim_start.tolist(), axes,
                           naxes.tolist())
    return Propagation(layouts, rules, sweeps)
