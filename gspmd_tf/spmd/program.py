"""The SPMD program and the builder handlers use to emit it.

The program is one Graph for every device, with local (per-device, padded) shapes. Its
nodes are TF ops, re-created by a backend from op type and attrs, or gt.* ops whose
behaviour depends on the device (see docs/INTERNALS.md).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import tensorflow as tf

from gspmd_tf.cost_model import CostModel
from gspmd_tf.graph.ir import Graph, Node, Ref, attr_value

Local = namedtuple("Local", "ref layout shape dtype")
Local.__doc__ = """A tensor of the SPMD program: `ref` holds this device's shard of a global
tensor of `shape` and `dtype` laid out by `layout`."""

# Handles whose shards cannot be resharded: a variable's (each device's points to its
# shard) and a TensorList's (each device's holds its shards of the elements). They keep
# the layout they have; the ops using them adapt their other operands.
# (A set: DType hashes by its enum, so `in` is a C look-up, not DType.__eq__ per item.)
UNMOVABLE = frozenset({tf.resource, tf.variant})

COLLECTIVES = ("gt.AllReduce", "gt.AllGather", "gt.ReduceScatter", "gt.AllToAll",
               "gt.Permute")
# A layout change the partitioner needs, explicit in the program until the export pass
# (spmd/export.py) lowers it to the collectives and local slices the planner plans.
RESHARD = "gt.Reshard"


def _all_empty(op, shapes, dtypes):
    """Whether a TF op's results all have no elements (and plain dtypes), so that it can
    be emitted as empty constants."""
    return (bool(shapes) and op != "Const" and not op.startswith("gt.")
            and all(0 in s for s in shapes)
            and all(d.is_numpy_compatible and d not in (tf.resource, tf.variant, tf.string)
                    for d in dtypes))


class ProgramBuilder:
    """Appends nodes to the SPMD program; every method returns Refs of local tensors.

    `prefix` starts the names it makes up (a region's sub-program has its own, so that
    node names are unique across a program and its regions: collective keys go by name).
    `cost_model` prices the reshard plans of this program (CostModel.for_mesh(mesh) by
    default)."""

    def __init__(self, mesh, prefix="", cost_model: CostModel | None = None):
        self.mesh = mesh
        self.cost_model = cost_model or CostModel.for_mesh(mesh)
        self.prefix = prefix
        self.graph = Graph()
        self._consts = {}
        # handlers' per-program caches, by handler (e.g. halo windows reused by a conv's
        # gradients)
        self.memo = {}
        # why the collectives emitted now exist (a provenance.Origin, set by the
        # partitioner), and every collective's origins by node name (shared with the
        # builders of the program's regions)
        self.origin = None
        self.origins = {}

    def _add(self, op, inputs, attrs, shapes, dtypes, params=None, name=None, regions=()):
        # (the first shape's test settles nearly every call without _all_empty's loop)
        if shapes and 0 in shapes[0] and _all_empty(op, shapes, dtypes):
            # No elements to compute: an empty constant. TF ops on empty tensors are
            # fragile (grappler's Mul-by-ones rewrite divides by a zero dim: SIGFPE).
            return [self.const(np.zeros(shape, dtype.as_numpy_dtype), dtype)
                    for shape, dtype in zip(shapes, dtypes)]
        name = name or f"{self.prefix}{op.replace('gt.', 'gt_')}_{len(self.graph.nodes)}"
        if name in self.graph._by_name:
            name = f"{name}_{len(self.graph.nodes)}"
        index = self.graph.add(Node(name, op, inputs, attrs, shapes, dtypes, params=params,
                                    regions=regions))
        if len(shapes) == 1:
            return [Ref(index, 0)]
        return [Ref(index, k) for k in range(len(shapes))]

    def op(self, op_type, inputs, shape, out_dtype, name=None, **attrs):
        """A single-output TF op; attrs given as python values or AttrValue protos."""
        return self._add(op_type, inputs, {k: attr_value(v) for k, v in attrs.items()},
                         [shape], [out_dtype], name=name)[0]

    def replay(self, node, inputs, shapes, dtypes, attrs=None, regions=()):
        """The TF op of an imported node re-created on local inputs; all its outputs.

        A control-flow op takes `regions`: its bodies' SPMD sub-programs."""
        merged = node.attrs  # Node() copies it
        if attrs:
            merged = dict(node.attrs)
            merged.update({k: attr_value(v) for k, v in attrs.items()})
        return self._add(node.op, inputs, merged, shapes, dtypes, name=node.name,
                         regions=regions)

    def const(self, value, dtype=None):
        """A constant (deduplicated by value)."""
        value = np.asarray(value, dtype=None if dtype is None else dtype.as_numpy_dtype)
        dtype = dtype or tf.as_dtype(value.dtype)
        key = (value.tobytes(), value.shape, dtype.name)
        if key not in self._consts:
            self._consts[key] = self.op("Const", [], value.shape, dtype, value=value,
                                        dtype=dtype)
        return self._consts[key]

    def input(self, index, shape, dtype, layout=None, var_dtype=None):
        """This device's shard of program input `index`; `layout`: the input's layout
        when known (a backend may read from it which devices hold equal shards);
        `var_dtype`: the dtype of the variable behind a resource input, when known."""
        params = {"index": index} if layout is None else {"index": index, "layout": layout}
        if var_dtype is not None:
            params["var_dtype"] = var_dtype
        ref = self._add("gt.Input", [], {}, [shape], [dtype], params=params)[0]
        self.graph.inputs.append(ref)
        return ref

    def shard_index(self, axes):
        """int32 scalar: this device's index along mesh `axes`."""
        return self._add("gt.ShardIndex", [], {}, [()], [tf.int32],
                         params={"axes": tuple(axes)})[0]

    def collective(self, kind, x, shape, dtype, **params):
        """A collective on local tensor `x` producing a local tensor of `shape`.

        A tensor with no elements carries no data: its result is an empty constant, and
        no collective runs (TF's collectives crash on empty tensors)."""
        assert kind in COLLECTIVES, kind
        if 0 in self.shape_of(x) or 0 in shape:
            return self.const(np.zeros(shape, dtype.as_numpy_dtype), dtype)
        ref = self._add(kind, [x], {}, [shape], [dtype], params=params)[0]
        if self.origin is not None:
            self.origins[self.graph.nodes[ref.node].name] = (self.origin,)
        return ref

    def reshard(self, x: Local, target, needed_by: str, reason: str,
                tensor: str | None = None) -> Ref:
        """A gt.Reshard node: `x` (a Local) moved to Layout `target`. Its params say
        what the export pass (spmd/export.py) needs to lower it (the global `shape`, the
        `source` and `target` layouts) and why it is there: `needed_by`, the op that
        needs it, `reason` (e.g. "operand layout", "contraction", "no rule") and, when
        known, `tensor`, the name of the traced graph's tensor it moves."""
        params = {"shape": x.shape, "source": x.layout, "target": target,
                  "needed_by": needed_by, "reason": reason}
        if tensor is not None:
            params["tensor"] = tensor
        return self._add(RESHARD, [x.ref], {}, [target.local_shape(self.mesh, x.shape)],
                         [x.dtype], params=params)[0]

    def shape_of(self, ref):
        """Local shape of a program tensor."""
        return self.graph.shape(ref)
