"""The annotated global graph: the traced program with gspmd-tf's shardings on every tensor,
for XLA's SPMD partitioner behind TF's XLA bridge (TPUStrategy, jit_compile).

Instead of the per-device SPMD program, the imported graph (global shapes) is emitted
again as TF ops, and every tensor it makes is followed by an XlaSharding op carrying the
sharding propagation chose for it (TF's own xla_sharding annotation: the serialized
OpSharding of gt.Sharding.from_layout). The reshards come from the same artifact the
per-device program is exported from: the explicit-reshard program
(SpmdProgram.explicit, spmd/export.py), whose every gt.Reshard names the traced tensor
it moves, the op that needs it and its source and target layouts. Where an op needed an
operand in another layout, the op reads it through XlaSharding ops with that layout, so
XLA's partitioner reshards where ours did instead of choosing its own strategy for the
op. Every reshard is annotated step by step: one XlaSharding op per layout the
planner's plan passes through (spmd/planner.py; e.g. a dim split over (y, x), the
mesh's devices in another order, between a reduce-scatter and an all-to-all); a result
moved from the layout it was computed in (e.g. a dot's partial sum reduce-scattered) is
annotated with the first of those layouts XLA can express, then the rest of the plan,
and an output moved to its out_shardings layout is returned through that plan, so XLA
moves what ours moves. Arguments that are placeholders of the graph being built also get
the `_XlaSharding` attr, which TF's bridge turns into the HLO parameter's sharding.
XLA's SPMD partitioner then partitions the program with our decisions, and XLA compiles
it whole (see docs/DESIGN_LOG.md, "TPU / XLA bridge").
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.compiler.xla.experimental import xla_sharding
from tensorflow.python.framework import ops

from gspmd_tf.backends.emitter import traced_region_op
from gspmd_tf.backends.tf_kernels import safe_name
from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Ref
from gspmd_tf.runtime.variables import variable_of_handle
from gspmd_tf.sharding import Sharding
from gspmd_tf.spmd import planner
from gspmd_tf.spmd.program import RESHARD

# Tensors that carry no array for XLA to split.
_UNSHARDED_DTYPES = (tf.resource, tf.variant)
# The ops on a captured variable that AnnotatedGraph.emit turns into value flow: reads,
# and writes of a new value.
_VARIABLE_OPS = {"ReadVariableOp": "read", "ResourceGather": "read",
                 "AssignVariableOp": "write", "AssignAddVariableOp": "write",
                 "AssignSubVariableOp": "write", "ResourceScatterAdd": "write",
                 "ResourceScatterSub": "write", "ResourceScatterUpdate": "write"}


def _scatter(update):
    """A ResourceScatter* op as value flow: rows `indices` of the value updated."""
    def scatter(value, indices, updates):
        return update(value, tf.expand_dims(indices, -1), updates)
    return scatter


# How each write computes the variable's new value from its current one and the op's
# other operands.
_WRITES = {"AssignVariableOp": lambda old, new: new,
           "AssignAddVariableOp": tf.add,
           "AssignSubVariableOp": tf.subtract,
           "ResourceScatterAdd": _scatter(tf.tensor_scatter_nd_add),
           "ResourceScatterSub": _scatter(tf.tensor_scatter_nd_sub),
           "ResourceScatterUpdate": _scatter(tf.tensor_scatter_nd_update)}


def explicit_reshards(lowered) -> tuple[dict, dict]:
    """The layout changes of the explicit-reshard program of `lowered` (its top level; a
    body's reach XLA through the body's own shardings): ({(needing op, tensor name):
    (source, target)}, the last such need of an op on a tensor winning, and {output
    tensor name: (source, target)} of the outputs moved to their out_shardings)."""
    needs, outputs = {}, {}
    for node in lowered.program.explicit.nodes:
        p = node.params
        if node.op == RESHARD and "tensor" in p:
            if p["reason"] == "annotation":
                outputs[p["tensor"]] = (p["source"], p["target"])
            else:
                needs[p["needed_by"], p["tensor"]] = (p["source"], p["target"])
    return needs, outputs


def _annotate(tensor, sharding):
    """`tensor` followed by an XlaSharding op carrying `sharding` (a gt.Sharding)."""
    return xla_sharding.Sharding(proto=sharding.to_proto()).apply_to_tensor(
        tensor, use_sharding_op=True)


class AnnotatedGraph:
    """Emits a lowered program's global graph with its shardings as XlaSharding ops.

    `emit(*inputs)` (inside a tf.function or a TPUStrategy replica function) re-creates
    every op of the traced graph on `inputs` (the program's flat arguments, then its
    captured variables' values, at global shapes) and returns the flat outputs, then
    every captured variable's final value: reads and writes of the variables become
    value flow (see _VARIABLE_OPS). With `operand_shardings=False` only the tensors are annotated, not the operand
    reshards (XLA then picks each op's strategy; benchmarks compare the two).
    """

    def __init__(self, lowered, operand_shardings=True):
        self.lowered = lowered
        self.operand_shardings = operand_shardings
        self._needs, self._moved_outputs = explicit_reshards(lowered)
        graph = lowered.graph
        self._shardings = [[self._sharding_of(i, k, dtype) for k, dtype in
                            enumerate(node.out_dtypes)]
                           for i, node in enumerate(graph.nodes)]

    def _sharding_of(self, index, out, dtype):
        """The sharding annotated on output `out` of node `index`, None for none (handles,
        and constants, which XLA folds and partitions from their users)."""
        graph = self.lowered.graph
        node = graph.nodes[index]
        # a captured variable's handle: the layout of the value it holds, placed on the
        # argument only (the bridge makes it the parameter's sharding)
        variable = dtype == tf.resource and "var_shape" in node.params
        if (dtype in _UNSHARDED_DTYPES and not variable) or node.op == "Const":
            return None
        layout = self.lowered.propagation.layouts[index][out]
        return Sharding.from_layout(self.lowered.mesh, layout)

    def emit(self, *inputs):
        """The program's flat outputs, then the final value of every captured variable
        (in capture order), computed by TF ops on the global `inputs`: the flat
        arguments, then the captured variables' values. Each variable's value carries
        its sharding on entry and after every write (the update written back sharded)."""
        graph = self.lowered.graph
        if len(inputs) != len(graph.inputs):
            raise ShardingError(
                f"the annotated graph of {self.lowered.name} takes {len(graph.inputs)} "
                f"inputs (arguments, then captured variables), got {len(inputs)}")
        bound = {ref.node: tf.convert_to_tensor(x) for ref, x in zip(graph.inputs, inputs)}
        captured = graph.inputs[len(graph.inputs) - len(graph.captures):]
        variables = {ref.node: None for ref in captured}  # -> the current value
        values, op_of = [], []
        resharded = {}  # (ref, layout) -> the tensor annotated with it
        default_graph = ops.get_default_graph()
        for index, node in enumerate(graph.nodes):
            if index in bound:
                outs = [self._argument(bound[index], self._shardings[index][0])]
                op_of.append(bound[index].op)
                if index in variables:
                    variables[index] = outs[0]
            elif any(r.node in variables for r in node.inputs):
                operands = self._operands(index, values, resharded)
                with tf.control_dependencies([op_of[c] for c in node.control_inputs]):
                    outs, op = self._variable_op(index, operands, variables)
                op_of.append(op)
            else:
                operands = self._operands(index, values, resharded)
                with tf.control_dependencies([op_of[c] for c in node.control_inputs]):
                    if node.regions:
                        # bodies as TF functions, as the local backend builds them (no
                        # device): XLA propagates the shardings into them
                        op = traced_region_op(node, operands)
                    else:
                        attrs = {k: v for k, v in node.attrs.items()
                                 if not k.startswith("_")}
                        op = default_graph._create_op_internal(
                            node.op, operands, dtypes=node.out_dtypes, attrs=attrs,
                            name=safe_name(node.name))
                op_of.append(op)
                outs = [self._result(index, k, t) for k, t in enumerate(op.outputs)]
            values.append(outs)
        return ([self._output(values[r.node][r.out], graph.tensor_name(r), r)
                 for r in graph.outputs]
                + [variables[ref.node] for ref in captured])

    def _output(self, tensor, name, ref):
        """An output tensor, annotated along its move to its out_shardings layout (the
        plan's layouts after its own) when the partitioner moved it."""
        moved = self._moved_outputs.get(name) if self.operand_shardings else None
        if moved is None or tensor.dtype in _UNSHARDED_DTYPES:
            return tensor
        graph = self.lowered.graph
        for layout in self._path(*moved, graph.shape(ref), graph.dtype(ref)):
            tensor = _annotate(tensor, Sharding.from_layout(self.lowered.mesh, layout))
        return tensor

    def written_variables(self):
        """Positions (in capture order) of the captured variables the program writes."""
        graph = self.lowered.graph
        count = len(graph.inputs) - len(graph.captures)
        position = {ref.node: k for k, ref in enumerate(graph.inputs[count:])}
        return sorted({position[node.inputs[0].node] for node in graph.nodes
                       if _VARIABLE_OPS.get(node.op) == "write"
                       and node.inputs[0].node in position})

    def _variable_op(self, index, operands, variables):
        """(outputs, op) of node `index`, an op on a captured variable, as value flow on
        the variable's current value in `variables` (updated for a write)."""
        graph = self.lowered.graph
        node = graph.nodes[index]
        handle = node.inputs[0].node
        kind = _VARIABLE_OPS.get(node.op)
        if kind is None or handle not in variables or any(
                r.node in variables for r in node.inputs[1:]):
            used = next(r.node for r in node.inputs if r.node in variables)
            raise ShardingError(
                f"op {node.name!r} ({node.op}) uses the captured variable "
                f"{graph.nodes[used].name!r} in a way the annotated graph cannot carry "
                f"as values (it takes {', '.join(sorted(_VARIABLE_OPS))}); update the "
                "variable with those (e.g. v.assign_sub) or pass the weight to the "
                "function as an argument")
        current = variables[handle]
        if kind == "write":
            written = _annotate(_WRITES[node.op](current, *operands[1:]),
                                self._shardings[handle][0])
            variables[handle] = written
            return [], written.op
        if node.op == "ReadVariableOp":
            read = tf.identity(current, name=safe_name(node.name))
        else:  # ResourceGather: a gather of the table's first dim after the batch dims
            batch_dims = node.attrs["batch_dims"].i if "batch_dims" in node.attrs else 0
            read = tf.gather(current, operands[1], axis=batch_dims, batch_dims=batch_dims,
                             name=safe_name(node.name))
        return [self._result(index, 0, read)], read.op

    def _result(self, index, out, tensor):
        """Output `out` of node `index` annotated: with its sharding, and first with the
        layouts the partitioner's result went through to reach it, if any."""
        sharding = self._shardings[index][out]
        if sharding is None:
            return tensor
        graph = self.lowered.graph
        node = graph.nodes[index]
        moved = self._needs.get((node.name, graph.tensor_name(Ref(index, out))))
        if self.operand_shardings and moved is not None:
            computed, target = moved
            layouts = self._path(computed, target, node.out_shapes[out], node.out_dtypes[out])
            if not computed.partial:
                layouts.insert(0, computed)
            for layout in layouts[:-1]:
                tensor = _annotate(tensor, Sharding.from_layout(self.lowered.mesh, layout))
        return _annotate(tensor, sharding)

    def _path(self, src, dst, shape, dtype):
        """The layouts a tensor passes through from Layout `src` to `dst` along the
        planner's plan (the steps the partitioner emitted), `dst` last; partial ones
        left out (an XLA sharding cannot say a sum is pending)."""
        if src == dst:
            return [dst]
        layouts, layout = [], src
        for step in planner.plan(src, dst, shape, dtype, self.lowered.mesh):
            layout = step.apply(layout)
            if not layout.partial:
                layouts.append(layout)
        return layouts

    def _operands(self, index, values, resharded):
        """The inputs of node `index`, each in the layout the explicit program's
        gt.Reshard for this op moved it to, if any (XlaSharding ops on the edge, one per
        layout of the reshard's plan)."""
        graph = self.lowered.graph
        node = graph.nodes[index]
        tensors = [values[r.node][r.out] for r in node.inputs]
        if not self.operand_shardings:
            return tensors
        for k, ref in enumerate(node.inputs):
            moved = self._needs.get((node.name, graph.tensor_name(ref)))
            if (moved is None or tensors[k].dtype in _UNSHARDED_DTYPES
                    or graph.nodes[ref.node].op == "Const"):
                continue
            source, layout = moved
            key = (ref, layout)
            if key not in resharded:
                tensor = tensors[k]
                for step in self._path(source, layout, graph.shape(ref), graph.dtype(ref)):
                    tensor = _annotate(tensor, Sharding.from_layout(self.lowered.mesh, step))
                resharded[key] = tensor
            tensors[k] = resharded[key]
        return tensors

    @staticmethod
    def _argument(tensor, sharding):
        """An input annotated: the `_XlaSharding` attr on a placeholder of the graph being
        built (TF's bridge makes it the HLO parameter's sharding), and an XlaSharding op."""
        if sharding is None:
            return tensor
        if tensor.op.type == "Placeholder" and tensor.graph is ops.get_default_graph():
            tensor.op._set_attr("_XlaSharding", attr_value_pb2.AttrValue(
                s=sharding.to_proto().SerializeToString()))
        return tensor if tensor.dtype in _UNSHARDED_DTYPES else _annotate(tensor, sharding)


class GlobalProgram:
    """The annotated global program of a Lowered, what backends/xla_bridge.py compiles
    (the protocol it reads): `emit(*inputs)` (AnnotatedGraph.emit), `written_variables()`,
    `num_outputs`, `variable_values()` (the captured gt.Variables' global values),
    `spmd` (gspmd-tf's per-device program of the same explicit-reshard program) and
    `as_text()` (annotated_text)."""

    def __init__(self, lowered):
        self.lowered = lowered
        self.name = lowered.name
        self.spmd = lowered.program.graph
        self.num_outputs = len(lowered.graph.outputs)
        self._annotated = AnnotatedGraph(lowered)

    def emit(self, *inputs):
        """The flat outputs, then the captured variables' final values (AnnotatedGraph)."""
        return self._annotated.emit(*inputs)

    def written_variables(self):
        """Positions (in capture order) of the captured variables the program writes."""
        return self._annotated.written_variables()

    def variable_values(self):
        """The global values of the captured variables, in capture order; ShardingError
        for a capture that is not a gt.Variable."""
        lowered = self.lowered
        graph = lowered.graph
        first = len(graph.inputs) - len(graph.captures)
        values = []
        for ref, handle in zip(graph.inputs[first:], graph.captures):
            source = variable_of_handle(handle)
            if source is None:
                raise ShardingError(
                    f"{lowered.name} captures {graph.nodes[ref.node].name!r}, which is not "
                    "a gt.Variable; the TPU program takes captured gt.Variables only: pass "
                    "other tensors to the function as arguments")
            values.append(source.numpy())
        return values

    def as_text(self):
        """The annotated graph, one TF op a line (annotated_text)."""
        return annotated_text(self.lowered)


def argument_specs(lowered):
    """TensorSpecs of the program's flat arguments (not its captured variables) at their
    global shapes."""
    graph = lowered.graph
    count = len(graph.inputs) - len(graph.captures)
    return [tf.TensorSpec(graph.shape(r), graph.dtype(r)) for r in graph.inputs[:count]]


def compiler_ir(lowered, stage="hlo", operand_shardings=True):
    """What TF's XLA bridge makes of the annotated graph of `lowered`, compiled for this
    host's XLA device (XLA_CPU_JIT here): `stage` as tf.function's
    experimental_get_compiler_ir takes it ("hlo", "hlo_serialized", "optimized_hlo", ...).

    Captured variables enter as values (AnnotatedGraph.emit): parameters
    after the arguments, sharded as the variables, and their final values are outputs
    after the program's, so a step that updates its variables compiles too (as a
    resource the bridge would need a sharding on every output, which a tf.function
    cannot give; docs/DESIGN_LOG.md). Nothing is allocated or run; abstract meshes work.
    `operand_shardings` as AnnotatedGraph takes it."""
    fn, specs = _annotated_function(lowered, operand_shardings)
    return fn.experimental_get_compiler_ir(*specs)(stage=stage)


def annotated_text(lowered, operand_shardings=True) -> str:
    """The annotated global graph of `lowered` as text, one TF op a line in graph order:
    `name = Type(input tensors)`, followed for an XlaSharding op, or an argument carrying
    the `_XlaSharding` attr, by ` sharding=` and the sharding in XLA's text. Nothing is
    compiled; abstract meshes work."""
    fn, specs = _annotated_function(lowered, operand_shardings)
    lines = []
    for op in fn.get_concrete_function(*specs).graph.get_operations():
        line = f"{op.name} = {op.type}({', '.join(t.name for t in op.inputs)})"
        attr = "sharding" if op.type == "XlaSharding" else "_XlaSharding"
        if attr in op.node_def.attr:
            line += f" sharding={Sharding.from_proto(op.node_def.attr[attr].s)}"
        lines.append(line)
    return "\n".join(lines)


def _annotated_function(lowered, operand_shardings):
    """(the jit-compiled tf.function emitting the annotated graph of `lowered`, the
    TensorSpecs it takes: the arguments', then the captured variables' values)."""
    graph = lowered.graph
    annotated = AnnotatedGraph(lowered, operand_shardings)
    specs = argument_specs(lowered)
    specs += [_variable_spec(graph, ref) for ref in graph.inputs[len(specs):]]

    def program(*inputs):
        return annotated.emit(*inputs)
    program.__name__ = safe_name(lowered.name or "program").replace("/", "_")
    return tf.function(program, jit_compile=True, autograph=False), specs


def _variable_spec(graph, ref):
    """The TensorSpec of the value of the captured variable `ref` (global shape)."""
    node = graph.nodes[ref.node]
    if graph.dtype(ref) != tf.resource:
        raise ShardingError(
            f"captured tensor {node.name!r} ({graph.dtype(ref).name}) is not a variable: "
            "pass it to the function as an argument to compile it through TF's XLA bridge")
    shape, dtype = node.params.get("var_shape"), node.params.get("var_dtype")
    if shape is None or dtype is None:
        raise ShardingError(f"captured variable {node.name!r} has no recorded shape/dtype")
    return tf.TensorSpec(shape, dtype)
