"""Import a traced TensorFlow function into the graph IR (see ir.py).

The traced graph's ops are read with their traced shapes. Nested function calls are
inlined; a callee's body is not taken from its own trace (which may have been traced on
relaxed shapes, e.g. an `input_signature` with None dims): its FunctionDef is imported
into a fresh tf.Graph fed with placeholders of the call site's shapes (and variable
handle data), so TF's shape inference gives every inlined tensor its shape at that call
site. Annotations are read from `_XlaSharding` attrs and XlaSharding ops, in the traced
graph and in inlined bodies alike. Call ops and NoOps add no node (control edges on them
are re-routed); every other op, Identity included, becomes one node.

Control-flow ops (While, If, Case and their Stateless forms) are not inlined: their bodies
are imported the same way, each into a Graph of its own (a region of the op's node), fed
with placeholders of the op's operand shapes; the placeholders are the region's inputs and
the body's returned tensors its outputs.

An operand that is a small integer constant at the call site (a shape, an axis, a count)
is also a constant inside the body (a loop's only when the loop hands it on unchanged):
the body reads a Const of that value, so TF's shape inference sees the shapes computed
from it (the dense shape of a sparse gradient entering a cond branch sizes the
UnsortedSegmentSum that densifies it: seed 24 #2379). The placeholder stays the body's
argument (and a region's input).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.compiler.xla import xla_data_pb2
from tensorflow.python.framework import function_def_to_graph
from tensorflow.python.ops import handle_data_util

from gspmd_tf.errors import ShardingError
from gspmd_tf.gc_pause import gc_paused
from gspmd_tf.graph.ir import REGION_OPS, Graph, Node, Ref
from gspmd_tf.graph.passes import IMPORT_PASSES, REGION_PASSES, run_passes
from gspmd_tf.registry import VALUE_SHAPED, has_trait

_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
# Handles: their shape is () whatever they point to, and TF may leave it unknown.
_HANDLE_DTYPES = frozenset({tf.resource, tf.variant})
# Constant operands sunk into a body are shape-like values, never a tensor's data (which
# would then be a replicated constant in the body rather than an operand of its sharding).
_SUNK_ELEMENTS = 64


# Ops no SPMD program can run as the user's program does, and why. The frame ops of TF1
# (v1) while loops: their back edge makes the graph cyclic, and a frame op run outside
# its frame on device-placed inputs hangs TF's executor. TensorSummary writes its own
# node name into its value, and each device's copy of an op has its own name.
_V1_LOOP = ("belongs to a TF1 while loop (control flow v1: Enter/NextIteration/Exit "
            "frames), which gspmd-tf does not partition; build the program with TF2 "
            "control flow (tf.while_loop inside a tf.function, or call "
            "tf.compat.v1.enable_control_flow_v2() before building the graph)")
_REFUSED_OPS = {
    **dict.fromkeys(("Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
                     "RefNextIteration", "LoopCond"), _V1_LOOP),
    # op sweep: partitioned, a lookup saw an empty table (the v2 ops are right)
    **dict.fromkeys(("HashTable", "MutableHashTable", "MutableHashTableOfTensors",
                     "MutableDenseHashTable", "InitializeTable", "InitializeTableFromTextFile",
                     "LookupTableFind", "LookupTableInsert", "LookupTableSize",
                     "LookupTableExport", "LookupTableImport"),
                    "is a TF1 lookup table op (a ref-typed handle), which gspmd-tf does not "
                    "partition: its lookups can miss what the table was filled with; use "
                    "the v2 tables (tf.lookup.StaticHashTable, tf.lookup.experimental."
                    "MutableHashTable)"),
    # op sweep: wrong weights. It shrinks v1 ref variables in place and returns nothing,
    # so only the traced graph's control edges order reads of them after it, and the SPMD
    # program orders state by resource variables (backends/ordering.py), not by those
    "SdcaShrinkL1": "shrinks v1 ref variables in place and returns nothing, so reads of "
                    "the weights after it are ordered only by control edges, which "
                    "gspmd-tf does not keep (it orders state through resource "
                    "variables): they could see the weights unshrunk; hold the weights in "
                    "tf.Variables and shrink them with tensor ops, w.assign(tf.sign(w) * "
                    "tf.maximum(tf.abs(w) - l1 / l2, 0.0))",
    "TensorSummary": "writes its node's name into its value, and every device's copy of "
                     "an op has a name of its own, so no partitioned value equals it; "
                     "write summaries with tf.summary (v2) outside the gt.function, or "
                     "use TensorSummaryV2, whose tag is an input",
    # the kernel returns output_rows + 1 (and output_cols + 1) region boundaries, TF's
    # shape inference one fewer (op sweep: FractionalMaxPool of a (2, 6, 5, 3) image,
    # ratios 1.5 and 1.25: inference (4,), the kernel (5,)); read at the inferred size a
    # sequence would lose its last boundary, and TF's graph cannot be told the kernel's
    # shape (set_shape refuses it)
    **dict.fromkeys(("FractionalMaxPool", "FractionalAvgPool"),
                    "has pooling sequences (outputs 1 and 2) whose shape TF's shape "
                    "inference gives one element shorter than its kernel returns, so "
                    "gspmd-tf cannot place them; run it outside gt.function (on the "
                    "gathered value) or use a max or average pool with a fixed window")}


def import_graph(fn, inputs: Optional[Sequence[tf.Tensor]] = None,
                 outputs: Optional[Sequence[tf.Tensor]] = None) -> Graph:
    """The IR of `fn`: a ConcreteFunction, a FuncGraph, or a tf.Graph.

    `inputs` and `outputs` (lists of tf.Tensor of the graph) default to the function's
    own; they are required for a plain tf.Graph. Raises ShardingError naming the first
    tensor whose shape is not fully defined.
    """
    if isinstance(fn, tf.Graph):
        graph = fn
        captures = list(getattr(graph, "external_captures", ()))
    else:
        graph = fn.graph
        captures = list(fn.captured_inputs)
    inputs = list(graph.inputs if inputs is None else inputs)
    outputs = list(graph.outputs if outputs is None else outputs)
    # The import allocates a few objects per op; with TF's hundreds of thousands of
    # live objects, the collections this triggers would double its time.
    with gc_paused():
        try:
            ir, ins, outs = _Importer(graph).run(graph, inputs, outputs)
        except ShardingError:
            # Shapes the trace left unknown only because a callee was traced on relaxed
            # shapes become known when TF re-infers the graph from its inputs' shapes (TF
            # infers through calls then); only the failure case pays for that re-import.
            if not (any(op.type in _CALL_OPS for op in graph.get_operations())
                    and all(t.op.type == "Placeholder" and t.shape.is_fully_defined()
                            for t in inputs)):
                raise
            body = _Body(graph.as_graph_def(), [t.name for t in inputs],
                         [_feed(t, t.shape) for t in inputs], [t.name for t in outputs])
            ir, ins, outs = _Importer(graph).run(body.graph, body.args, body.outputs)
    ir.inputs, ir.outputs, ir.captures = ins, outs, captures
    for t, ref in zip(inputs, ins):
        if t.dtype == tf.resource:
            _record_variable(t, ir.nodes[ref.node])
    # the clean-ups (graph/passes.py): shape computations become constants, rotations
    # written as slices and a concat become Roll, TensorLists take their elements' shape
    return run_passes(ir, IMPORT_PASSES)


class _Importer:
    """Walks a graph and the bodies of the functions it calls, appending IR nodes."""

    def __init__(self, root, bodies=None):
        self.root = root  # where the function library lives
        self.ir = Graph()
        self.ir.unknown_shapes = {}  # Ref -> tf.TensorShape, left to fold() to resolve
        self.bodies = {} if bodies is None else bodies  # (function name, feeds) -> _Body

    def run(self, graph, inputs, outputs):
        """Imports `graph`; returns the IR and the Refs of `inputs` and `outputs`."""
        refs, _ = self.walk(graph, "", {}, [])
        ref = lambda t: refs[t.op][t.value_index]
        return self.ir, [ref(t) for t in inputs], [ref(t) for t in outputs]

    def walk(self, graph, prefix, bound, call_control):
        """Adds the ops of `graph` to the IR; returns ({op: [Ref]}, {op: [node index]}).

        An op's IR name is `prefix + op.name`. `bound` maps the ops standing for
        values from outside (a callee's arguments) to their Ref; they add no node. Ops
        that depend on no other op of `graph` also get the control inputs `call_control`.
        """
        refs = {op: [ref] for op, ref in bound.items()}
        # What a control edge on an op means in the IR: the node indices to wait for.
        control = {op: [ref.node] for op, ref in bound.items()}
        start = len(self.ir.nodes)
        for op, in_tensors, in_ops in _topological(graph):
            if op in bound:
                continue
            inputs = [refs[t.op][t.value_index] for t in in_tensors]
            deps = [i for c in in_ops for i in control[c]] if in_ops else []
            if call_control and all(ref.node < start for ref in inputs):
                deps += call_control
            if len(deps) > 1:
                deps = list(dict.fromkeys(deps))
            op_type = op.type
            if op_type in _REFUSED_OPS:
                raise ShardingError(f"op '{prefix + op.name}' ({op_type}) "
                                    f"{_REFUSED_OPS[op_type]}")
            if op_type == "NoOp":  # dropped; control edges on it go to its own deps
                control[op] = deps
                continue
            name = prefix + op.name
            node_def = op.node_def
            if op_type in _CALL_OPS:
                outs, control[op] = self.inline(op, node_def.attr["f"].func.name, name,
                                                inputs, deps)
            else:
                outs = op.outputs
                regions = ()
                if op_type in REGION_OPS:
                    _check_loop_shapes(op, name)
                    regions = self.regions(op, name, inputs)
                unknown = self.ir.unknown_shapes
                shapes = [_known_shape(t) for t in outs]
                if None not in shapes:  # the common case
                    pending = ()
                else:
                    # shapes that depend on values (of constants, once folded): fold.py
                    defer = has_trait(op_type, VALUE_SHAPED) or (
                        unknown and any(ref in unknown for ref in inputs))
                    like = (self.ir.shape(inputs[0]) if op_type in _SHAPE_OF_INPUT
                            and inputs[0] not in unknown else None)
                    shapes = [_static_shape(t, name, bool(prefix), defer, like)
                              for t in outs]
                    pending = [k for k, shape in enumerate(shapes) if shape is None]
                    shapes = [shape or () for shape in shapes]
                attr = node_def.attr
                index = self.ir.add(Node(
                    name, op_type, inputs,
                    # Underscore attrs are TF's bookkeeping (shapes, colocation,
                    # shardings...), never part of an OpDef: re-creating the op must
                    # not copy them. (Keys, not items(): the proto map's items() is
                    # a Python-level view, twice as slow.)
                    attrs={k: attr[k] for k in attr if k[0] != "_"},
                    out_shapes=shapes,
                    out_dtypes=[t.dtype for t in outs],
                    control_inputs=deps, regions=regions))
                for k in pending:
                    unknown[Ref(index, k)] = outs[k].shape
                outs = ([Ref(index, 0)] if len(outs) == 1
                        else [Ref(index, k) for k in range(len(outs))])
                control[op] = [index]
            refs[op] = outs
            if op_type == "XlaSharding" or "_XlaSharding" in node_def.attr:
                self.annotate(op, node_def, outs)
        return refs, control

    def body(self, callee, feeds):
        """The _Body of function `callee` fed with `feeds` (imported once per feeds)."""
        key = (callee, tuple((dtype, shape, data and data.SerializeToString(),
                              None if value is None else value.tobytes())
                             for dtype, shape, data, value in feeds))
        if key not in self.bodies:
            self.bodies[key] = _Body.of_function(self.root, callee, feeds)
        return self.bodies[key]

    def inline(self, op, callee, name, inputs, deps):
        """Inlines the call `op` under `name/`; returns its output Refs and control."""
        feeds = tuple(_feed(t, self.ir.shape(ref), _sinkable_value(t))
                      for t, ref in zip(op.inputs, inputs))
        body = self.body(callee, feeds)
        bound = {arg.op: ref for arg, ref in zip(body.args, inputs)}
        refs, control = self.walk(body.graph, name + "/", bound, deps)
        outs = [refs[t.op][t.value_index] for t in body.outputs]
        for k, ref in enumerate(outs):
            self.ir.aliases[f"{name}:{k}"] = ref
        # A control edge on the call waits for the ops it must run (as TF's inliner does
        # for functions with control outputs, i.e. every tf.function).
        waits = [i for c in body.control_outputs for i in control[c]]
        return outs, list(dict.fromkeys(waits))

    def regions(self, op, name, inputs):
        """The bodies of control-flow op `op` (IR node `name`, input Refs `inputs`) as
        region Graphs, in REGION_OPS order, named `name/<attr>/...`."""
        attr_names, first = REGION_OPS[op.type]
        feeds = []
        for t, ref in list(zip(op.inputs, inputs))[first:]:
            if ref in self.ir.unknown_shapes:
                raise ShardingError(
                    f"op '{name}' ({op.type}) takes '{t.name}', whose shape depends on "
                    "values gspmd-tf cannot fold to constants; give that tensor a static "
                    "shape (e.g. tf.ensure_shape) before the control-flow op")
            feeds.append(_feed(t, self.ir.shape(ref), _sinkable_value(t)))
        feeds = tuple(feeds)
        if "While" in op.type:  # constant in the loop only when the body passes it on
            unvalued = tuple(f[:3] + (None,) for f in feeds)
            passed_on = _passed_on(self.body(op.node_def.attr["body"].func.name, unvalued))
            feeds = tuple(f if k in passed_on else unvalued[k] for k, f in enumerate(feeds))
        regions = []
        for attr in attr_names:
            value = op.node_def.attr[attr]
            if value.HasField("list"):  # Case's branches: one region per function
                labelled = [(f"{attr}_{k}", f.name) for k, f in enumerate(value.list.func)]
            else:
                labelled = [(attr, value.func.name)]
            for label, callee in labelled:
                regions.append(self.region(self.body(callee, feeds), f"{name}/{label}/"))
        return regions

    def region(self, body, prefix):
        """`body` imported into a Graph of its own (names prefixed by `prefix`): its
        argument placeholders are the Graph's inputs, its returned tensors its outputs."""
        child = _Importer(self.root, self.bodies)
        refs, _ = child.walk(body.graph, prefix, {}, [])
        region = child.ir
        region.inputs = [refs[arg.op][0] for arg in body.args]
        region.outputs = [refs[t.op][t.value_index] for t in body.outputs]
        for arg, ref in zip(body.args, region.inputs):
            if arg.dtype == tf.resource:
                _record_variable(arg, region.nodes[ref.node])
        return run_passes(region, REGION_PASSES)

    def annotate(self, op, node_def, outs):
        """Records the sharding `op` carries (if any) on its output tensors `outs`."""
        attrs = node_def.attr
        # `_XlaSharding` first: xla_sharding sets it last, also on the XlaSharding ops.
        # Its value may be empty: that is a REPLICATED proto. An XlaSharding op's own
        # `sharding` attr is empty by default, which annotates nothing.
        if "_XlaSharding" in attrs:
            data = attrs["_XlaSharding"].s
        elif op.type == "XlaSharding" and attrs["sharding"].s:
            data = attrs["sharding"].s
        else:
            return
        proto = xla_data_pb2.OpSharding.FromString(data)
        if proto.type == xla_data_pb2.OpSharding.TUPLE:
            if len(proto.tuple_shardings) != len(outs):
                raise ShardingError(
                    f"op '{op.name}' has {len(outs)} outputs but its tuple sharding has "
                    f"{len(proto.tuple_shardings)} elements")
            pairs = zip(outs, proto.tuple_shardings)
        else:  # one sharding for every output, as tf2xla applies it
            pairs = ((ref, proto) for ref in outs)
        for ref, sharding in pairs:
            self.ir.annotations[ref] = sharding


class _Body:
    """A GraphDef imported into a fresh tf.Graph, its arguments replaced by placeholders
    of given shapes (and handle data), so that TF infers every shape from those.

    `args` are the placeholders (named as the arguments they replace), `outputs` the
    returned tensors, `control_outputs` the ops that must run. An argument fed with a
    value (see _feed) is read as a Const of that value ("<argument>/value").
    """

    def __init__(self, graph_def, arg_names, feeds, return_names, control_names=()):
        arg_ops = {name.split(":")[0] for name in arg_names}
        kept = [node for node in graph_def.node if node.name not in arg_ops]
        for node in kept:
            # Colocation with nodes outside the body (a while gradient's body colocates
            # a GatherV2 gradient's Shape with the forward graph's params) would fail the
            # import; placement is the backend's anyway.
            if "_class" in node.attr:
                del node.attr["_class"]
        del graph_def.node[:]
        graph_def.node.extend(kept)
        # import_graph_def rejects mappings of tensors that are neither in graph_def nor
        # read there, so only map what is read.
        used = {name if ":" in name or name[0] == "^" else name + ":0"
                for node in kept for name in node.input}
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.args, input_map = [], {}
            for name, (dtype, shape, handle_data, value) in zip(arg_names, feeds):
                op_name = name.split(":")[0]
                arg = tf.compat.v1.placeholder(dtype, shape, name=op_name)
                if handle_data is not None:  # for ReadVariableOp, TensorListGetItem...
                    handle_data_util.set_handle_data(arg, handle_data)
                self.args.append(arg)
                read = arg if value is None else tf.constant(value, dtype,
                                                             name=op_name + "/value")
                for key, source in ((name, read), ("^" + op_name, arg)):
                    if key in used:
                        input_map[key] = source
            args = dict(zip(arg_names, self.args))  # a body may return an argument
            returns = iter(tf.graph_util.import_graph_def(
                graph_def, input_map=input_map, name="",
                return_elements=[n for n in return_names if n not in args]
                + list(control_names)))
        self.outputs = [args[n] if n in args else next(returns) for n in return_names]
        self.control_outputs = list(returns)

    @classmethod
    def of_function(cls, root, callee, feeds):
        """The body of the function `callee` of `root`'s library."""
        # function_def_to_graph looks nested functions up in the default graph.
        with root.as_default():
            fdef = function_def_to_graph.get_function_def(callee, root)
            graph_def, names = function_def_to_graph.function_def_to_graph_def(
                fdef, include_library_functions=True)
        signature = fdef.signature
        return cls(graph_def, [names[arg.name] for arg in signature.input_arg], feeds,
                   [names[fdef.ret[arg.name]] for arg in signature.output_arg],
                   list(fdef.control_ret.values()))


def _feed(tensor, shape, value=None):
    """(dtype, shape, handle data or None, value or None) of a placeholder standing for
    `tensor`; `value`, when given, is the value the body reads in its place."""
    handle_data = None
    if tensor.dtype in _HANDLE_DTYPES:
        # A handle is a scalar to TF (the IR gives a variable's handle its variable's
        # shape instead); the variable's shape, or a TensorList's element shape, travels
        # in the handle data.
        shape = ()
        handle_data = handle_data_util.get_resource_handle_data(tensor)
        if not handle_data.is_set:
            handle_data = None
    return tensor.dtype, tuple(shape), handle_data, value


def _sinkable_value(tensor):
    """The value (np.ndarray) of `tensor` when it is a small integer constant TF computes
    from the graph alone (a Const, the Shape of a static tensor...), else None."""
    if not tensor.dtype.is_integer:
        return None
    size = tensor.shape.num_elements()
    if size is None or size > _SUNK_ELEMENTS:
        return None
    value = tf.get_static_value(tensor)
    return None if value is None else np.asarray(value, tensor.dtype.as_numpy_dtype)


def _passed_on(body):
    """Indices of the arguments of loop body `body` (a _Body) that it returns unchanged
    in the same position (through Identity ops): their value is the same every
    iteration."""
    passed = set()
    for k, (arg, out) in enumerate(zip(body.args, body.outputs)):
        while out.op.type == "Identity" and out.name != arg.name:
            out = out.op.inputs[0]
        if out.name == arg.name:
            passed.add(k)
    return passed


def _topological(graph):
    """(op, input tensors, control input ops) for every op of `graph`, each op after
    the ops it reads or waits for.

    TF creates ops after their data inputs, but control edges may be added later
    (e.g. a function's outputs wait on a NoOp created after them).
    """
    edges = {op: (op.inputs, op.control_inputs) for op in graph.get_operations()}
    deps = lambda op: iter([t.op for t in edges[op][0]] + edges[op][1])
    order, seen = [], set()
    for root in edges:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, deps(root))]
        while stack:
            op, pending = stack[-1]
            for dep in pending:
                if dep not in seen:
                    seen.add(dep)
                    stack.append((dep, deps(dep)))
                    break
            else:
                stack.pop()
                order.append((op,) + edges[op])
    return order


def _check_loop_shapes(op, name):
    """ShardingError when an output of control-flow op `op` (IR node `name`) has a shape
    TF leaves unknown: a loop-carried value whose shape changes between iterations, or
    branches returning different shapes."""
    for t in op.outputs:
        if t.dtype in _HANDLE_DTYPES or t.shape.is_fully_defined():
            continue
        label = f"{name}:{t.value_index}"
        if "While" in op.type:
            raise ShardingError(
                f"loop '{name}' ({op.type}) carries '{label}' with shape {t.shape}: its shape "
                "may change between iterations (relaxed by shape_invariants, or not "
                "inferable by TF); gspmd-tf needs every loop-carried value to keep one "
                "static shape: drop the shape_invariants and keep the shape fixed (e.g. "
                "preallocate the full size and write into it, or collect values in a "
                "tf.TensorArray)")
        raise ShardingError(
            f"op '{name}' ({op.type}) returns '{label}' with shape {t.shape}: its branches "
            "return different shapes; gspmd-tf needs static shapes: make every branch "
            "return the same shape (e.g. pad to the largest)")


# Scratch outputs TF's shape inference leaves without even a rank: their only reader is
# the op's gradient, which on CPU ignores them; the CPU kernel makes them scalars.
_SCRATCH_OUTPUTS = frozenset({("FusedBatchNormV3", 5)})
# ops whose one output has the shape of their first input (the gradient tape's zeros for
# an unused scratch output)
_SHAPE_OF_INPUT = frozenset({"ZerosLike", "OnesLike", "Identity"})

def _known_shape(tensor):
    """The shape of `tensor` as a tuple of ints; None when TF left any of it unknown."""
    shape = tensor.shape
    if shape.rank is None:
        return None
    dims = tuple(shape.as_list())
    return None if None in dims else dims


def _static_shape(tensor, name, nested, defer=False, like=None):
    """The shape of `tensor` (an output of IR node `name`, `nested` in an inlined
    function) as a tuple of ints; None when unknown and `defer` (fold() resolves it).
    `like`: the IR shape of the op's input, for ops whose output has that shape."""
    shape = tensor.shape
    if shape.is_fully_defined():
        return tuple(shape.as_list())
    if like is not None and shape.is_compatible_with(like):
        return like
    if tensor.dtype in _HANDLE_DTYPES or (
            shape.rank is None and (tensor.op.type, tensor.value_index) in _SCRATCH_OUTPUTS):
        return ()
    if defer:
        return None
    label = name if tensor.value_index == 0 else f"{name}:{tensor.value_index}"
    hint = ("; a tf.function called inside must have them too (its input_signature, "
            "if any)" if nested else "")
    raise ShardingError(
        f"tensor '{label}' has shape {shape} with unknown dimensions; gspmd-tf needs "
        "static shapes: trace with fully defined shapes (e.g. pass tf.TensorSpec with "
        f"a full shape){hint}")


def _record_variable(tensor, node):
    """Records the shape and dtype of the variable behind resource `tensor` in
    node.params ("var_shape", "var_dtype"), when TF knows them."""
    data = handle_data_util.get_resource_handle_data(tensor)
    if not (data.is_set and data.shape_and_type):
        return
    shape = data.shape_and_type[0].shape
    if shape.unknown_rank or any(d.size < 0 for d in shape.dim):
        return
    node.params["var_shape"] = tuple(d.size for d in shape.dim)
    node.params["var_dtype"] = tf.dtypes.as_dtype(data.shape_and_type[0].dtype)
    # In the IR a variable handle has the shape of the variable: propagation and the
    # partitioner treat it as standing for the value it holds.
    node.out_shapes[0] = node.params["var_shape"]
