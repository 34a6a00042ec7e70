"""The graph IR shared by the importer, propagation, the partitioner and backends."""

from __future__ import annotations

from collections import namedtuple

import numpy as np

Ref = namedtuple("Ref", "node out")
Ref.__doc__ = "A tensor: output `out` of the node at index `node`."

# Control-flow ops whose bodies are regions: op type -> (the function attrs holding the
# bodies, in region order; the position of the first op input passed to the bodies).
# A list(func) attr (Case's branches) gives one region per function.
REGION_OPS = {
    "While": (("cond", "body"), 0),
    "StatelessWhile": (("cond", "body"), 0),
    "If": (("then_branch", "else_branch"), 1),
    "StatelessIf": (("then_branch", "else_branch"), 1),
    "Case": (("branches",), 1),
    "StatelessCase": (("branches",), 1),
}


class Node:
    """One op: TF op type and attrs (to re-create it), inputs, output shapes and dtypes.

    `params` holds python values for gspmd-tf's own ops (gt.*) in SPMD programs.
    `regions` holds the bodies of a control-flow op (REGION_OPS) as Graphs, in the order
    REGION_OPS gives (While: cond, body; If: then, else; Case: one per branch); each
    region's inputs are its parameters, fed by `region_operands()`, and its outputs its
    results (see docs/DESIGN_LOG.md, "Regions").
    """

    __slots__ = ("name", "op", "inputs", "control_inputs", "attrs", "out_shapes",
                 "out_dtypes", "params", "regions")

    def __init__(self, name, op, inputs=(), attrs=None, out_shapes=(), out_dtypes=(),
                 control_inputs=(), params=None, regions=()):
        self.name = name
        self.op = op
        # copies, so a caller may pass (and keep using) its own containers; the C-level
        # forms below because importer and partitioner make one Node per op
        self.inputs = list(inputs)
        self.control_inputs = list(control_inputs)
        self.attrs = dict(attrs) if attrs else {}
        self.out_shapes = list(map(tuple, out_shapes))
        self.out_dtypes = list(out_dtypes)
        self.params = dict(params) if params else {}
        self.regions = list(regions)

    def region_operands(self):
        """The inputs passed to every region's parameters, in order (While: all of them;
        If/Case: all but the predicate or branch index)."""
        return self.inputs[REGION_OPS[self.op][1]:] if self.regions else []

    def attr(self, name, default=None):
        """The TF attr `name` decoded to a python value (default when absent)."""
        if name not in self.attrs:
            return default
        return decode_attr(self.attrs[name])

    def __repr__(self):
        return f"<Node {self.name} {self.op} {self.out_shapes}>"


def decode_attr(value):
    """An AttrValue proto as a python value: int, float, bool, str, DType, list, ndarray."""
    import tensorflow as tf

    kind = value.WhichOneof("value")
    if kind == "list":
        lst = value.list
        for field in ("i", "f", "b", "s", "type", "shape", "tensor"):
            items = list(getattr(lst, field))
            if items:
                return [decode_attr_scalar(field, item) for item in items]
        return []
    if kind is None:
        return None
    return decode_attr_scalar(kind, getattr(value, kind))


def attr_value(value):
    """A python value as an AttrValue proto (the inverse of decode_attr)."""
    import tensorflow as tf
    from tensorflow.core.framework import attr_value_pb2

    if isinstance(value, attr_value_pb2.AttrValue):
        return value
    if isinstance(value, tf.DType):
        return attr_value_pb2.AttrValue(type=value.as_datatype_enum)
    if isinstance(value, bool):
        return attr_value_pb2.AttrValue(b=value)
    if isinstance(value, (int, np.integer)):
        return attr_value_pb2.AttrValue(i=int(value))
    if isinstance(value, float):
        return attr_value_pb2.AttrValue(f=value)
    if isinstance(value, str):
        return attr_value_pb2.AttrValue(s=value.encode())
    if isinstance(value, np.ndarray):
        return attr_value_pb2.AttrValue(tensor=tf.make_tensor_proto(value))
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, tf.DType) for v in value) and value:
            return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                type=[v.as_datatype_enum for v in value]))
        return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
            i=[int(v) for v in value]))
    raise TypeError(f"no AttrValue for {value!r}")


def decode_attr_scalar(kind, item):
    """One AttrValue field as a python value."""
    import tensorflow as tf

    if kind == "s":
        return item.decode("utf-8", "replace") if isinstance(item, bytes) else item
    if kind == "type":
        return tf.dtypes.as_dtype(item)
    if kind == "shape":
        return None if item.unknown_rank else tuple(d.size for d in item.dim)
    if kind == "tensor":
        return tf.make_ndarray(item)
    return item


class Graph:
    """Topologically ordered nodes, with the function's inputs, outputs and annotations.

    `inputs` are the traced function's arguments, then its captured tensors; `captures`
    holds the captured values (same order as the tail of `inputs`); `annotations` maps a
    tensor to the sharding a user asked for, as an xla_data_pb2.OpSharding (from an
    XlaSharding op or attr; runtime/lowering.py turns it into a Layout). `aliases` maps names ("op:k") of tensors
    that have no node of their own (outputs of inlined function calls) to their Ref.
    A region (a body of a control-flow op, Node.regions) is a Graph whose inputs are its
    parameters (Placeholder nodes) and whose outputs are its results.
    """

    def __init__(self):
        self.nodes = []
        self.inputs = []
        self.outputs = []
        self.captures = []
        self.annotations = {}
        self.aliases = {}
        self._by_name = {}

    def add(self, node):
        """Append a node; returns its index."""
        index = len(self.nodes)
        self._by_name[node.name] = index
        self.nodes.append(node)
        return index

    def node_index(self, name):
        """Index of the node called `name` (KeyError when there is none)."""
        return self._by_name[name]

    def ref(self, name):
        """The tensor called "op" or "op:k" (a node's output, or an alias)."""
        op, _, out = name.partition(":")
        out = int(out or 0)
        if op in self._by_name:
            return Ref(self._by_name[op], out)
        return self.aliases[f"{op}:{out}"]

    def shape(self, ref):
        """Static shape of a tensor."""
        return self.nodes[ref.node].out_shapes[ref.out]

    def dtype(self, ref):
        """DType of a tensor."""
        return self.nodes[ref.node].out_dtypes[ref.out]

    def tensor_name(self, ref):
        """"op" for output 0, "op:k" otherwise."""
        name = self.nodes[ref.node].name
        return name if ref.out == 0 else f"{name}:{ref.out}"

    def consumers(self):
        """For every node, the list of (consumer node index, input position)."""
        users = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            for pos, ref in enumerate(node.inputs):
                users[ref.node].append((i, pos))
        return users

    def const_value(self, ref):
        """The numpy value of a Const tensor, or None if `ref` is not a constant."""
        node = self.nodes[ref.node]
        if node.op != "Const":
            return None
        return np.asarray(node.attr("value"))


def walk(graph):
    """Every node of `graph`, each control-flow node followed by the nodes of its regions
    (recursively, region by region): one fixed order for a program and its bodies."""
    for node in graph.nodes:
        yield node
        for region in node.regions:
            yield from walk(region)
