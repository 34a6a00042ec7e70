"""Propagation driver: encode the graph and its rules as arrays, run the Cython core.

Priority, highest first: (1) user annotations are fixed and never changed; (2) rules
extend every other tensor, one op at a time, adding mesh axes to dims but never removing
them: an op gives each of its factors the most-split candidate its tensors offer, and
a tensor dim takes its factors' axes when its current axes are a prefix of them.
Sweeps alternate forward and backward over the graph until nothing changes. Tensors left
without axes are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gspmd_tf import _propagation
from gspmd_tf.layout import Layout
from gspmd_tf.propagation.rules import rule_for

MAX_AXES = 4
MAX_FACTORS = 64


@dataclass
class Propagation:
    """Result: a Layout per tensor (layouts[node][out]) and the rule of every node."""

    layouts: list
    rules: list
    sweeps: int

    def layout(self, ref):
        """Layout of tensor `ref`."""
        return self.layouts[ref.node][ref.out]


class _Encoder:
    """Collects the flat arrays the core reads."""

    def __init__(self, graph, mesh):
        self.axis_id = {name: i for i, name in enumerate(mesh.axis_names)}
        self.tensor_base = []
        ranks = []
        for node in graph.nodes:
            self.tensor_base.append(len(ranks))
            ranks.extend(len(s) for s in node.out_shapes)
        self.rank = np.asarray(ranks, dtype=np.int32)
        self.dim_start = np.zeros(len(ranks) + 1, dtype=np.int32)
        np.cumsum(self.rank, out=self.dim_start[1:])
        num_dims = int(self.dim_start[-1])
        self.axes = np.full((max(num_dims, 1), MAX_AXES), -1, dtype=np.int8)
        self.naxes = np.zeros(max(num_dims, 1), dtype=np.int8)
        self.fixed = np.zeros(len(ranks), dtype=np.uint8)
        self.axis_size = np.asarray(mesh.shape, dtype=np.int32)
        self.slot_start, self.factor_start = [0], [0]
        self.slot_tensor, self.dim_factor_start, self.dim_factors = [], [0], []
        self.factor_size, self.factor_kind = [], []

    def tensor(self, ref):
        return self.tensor_base[ref.node] + ref.out

    def seed(self, ref, layout, fixed):
        t = self.tensor(ref)
        for d, names in enumerate(layout.dims):
            row = self.dim_start[t] + d
            self.axes[row, :len(names)] = [self.axis_id[n] for n in names]
            self.naxes[row] = len(names)
        self.fixed[t] = fixed

    def add_op(self, tensors_dims):
        """One op: a list of (tensor id, per-dim factor tuples); factors added before."""
        for t, dims in tensors_dims:
            self.slot_tensor.append(t)
            for factors in dims:
                self.dim_factors.extend(factors)
                self.dim_factor_start.append(len(self.dim_factors))
        self.slot_start.append(len(self.slot_tensor))
        self.factor_start.append(len(self.factor_size))

    def run(self, users):
        i32 = lambda a: np.asarray(a, dtype=np.int32)
        slot_tensor = i32(self.slot_tensor)
        slot_dim_start = np.zeros(len(slot_tensor) + 1, dtype=np.int32)
        np.cumsum(self.rank[slot_tensor], out=slot_dim_start[1:])
        tensor_op_start = np.zeros(len(self.rank) + 1, dtype=np.int32)
        np.cumsum([len(u) for u in users], out=tensor_op_start[1:])
        tensor_ops = i32([op for u in users for op in u])
        return _propagation.propagate_arrays(
            self.rank, self.dim_start[:-1].copy(), self.fixed, self.axes, self.naxes,
            self.axis_size, i32(self.slot_start), i32(self.factor_start), slot_tensor,
            slot_dim_start, i32(self.dim_factor_start), i32(self.dim_factors),
            i32(self.factor_size), np.asarray(self.factor_kind, dtype=np.int8),
            tensor_op_start, tensor_ops)


def propagate(graph, mesh, seeds):
    """Give every tensor of `graph` a Layout on `mesh`.

    `seeds` maps Refs to the Layouts users asked for; those are fixed. Returns a
    Propagation with the layouts and the OpRule of every node (None: no rule).
    """
    enc = _Encoder(graph, mesh)
    for ref, layout in seeds.items():
        enc.seed(ref, layout, fixed=1)
    rules = []
    users = [[] for _ in range(len(enc.rank))]
    for index, node in enumerate(graph.nodes):
        rule = rule_for(graph, node)
        if rule is not None and len(rule.factor_sizes) > MAX_FACTORS:
            rule = None
        rules.append(rule)
        if rule is None:
            continue
        op = len(enc.slot_start) - 1
        slots = [(enc.tensor(ref), dims) for ref, dims in zip(node.inputs, rule.operands)
                 if dims is not None]
        slots += [(enc.tensor_base[index] + k, dims) for k, dims in enumerate(rule.results)
                  if dims is not None]
        for t, _ in slots:
            users[t].append(op)
        enc.factor_size.extend(rule.factor_sizes)
        enc.factor_kind.extend(rule.factor_kinds)
        enc.add_op(slots)
    sweeps = enc.run(users)
    names = mesh.axis_names
    layouts = []
    for index, node in enumerate(graph.nodes):
        outs = []
        for k in range(len(node.out_shapes)):
            t = enc.tensor_base[index] + k
            rows = range(enc.dim_start[t], enc.dim_start[t + 1])
            outs.append(Layout(tuple(tuple(names[a] for a in enc.axes[r, :enc.naxes[r]])
                                     for r in rows)))
        layouts.append(outs)
    return Propagation(layouts, rules, sweeps)
