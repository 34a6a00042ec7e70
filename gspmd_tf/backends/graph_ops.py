"""Creating the per-device program's TF ops through TF's C API, without the Python graph
layers a user's op goes through.

The per-device emitter creates ~3,900 ops for GPT-2's train step on 8 devices (17,600
for MobileNetV2's). Through Graph._create_op_internal each cost ~0.3 ms of Python: a
NodeDef built and its attrs serialized per op, name and size checks, the Python stack
recorded on the op, device functions, colocation and control-flow bookkeeping. None of
it changes the op the emitter makes (its device is known, its attrs are the traced
node's), so `create_op` makes the same op from attrs serialized once per node
(`OpTemplate`), and falls back to _create_op_internal wherever a graph state the lean
path does not handle is active (`_lean_applies`). Not recorded: the Python stack of the
op's creation (a runtime error names the op, which carries the program node's name)."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.client import pywrap_tf_session as c_api
from tensorflow.python.framework import errors, func_graph, op_def_registry, ops


class OpTemplate:
    """An op type with its attrs, serialized once for every op `create_op` makes of it:
    the input grouping (list inputs of the op def) and the attrs as C API bytes."""

    def __init__(self, op_def, attrs: Mapping[str, attr_value_pb2.AttrValue]):
        """`op_def`: the OpDef of the op type (Graph.op_def_for_type)."""
        self.op_type = op_def.name
        self.attrs = dict(attrs)
        self.serialized = [(k, v.SerializeToString()) for k, v in self.attrs.items()]
        # per input arg: None for one tensor, else the length of its list
        self.grouping = []
        for arg in op_def.input_arg:
            if arg.number_attr:
                self.grouping.append(self.attrs[arg.number_attr].i)
            elif arg.type_list_attr:
                self.grouping.append(len(self.attrs[arg.type_list_attr].list.type))
            else:
                self.grouping.append(None)


def simple_template(op_type: str, dtype, count: Optional[int] = None) -> OpTemplate:
    """The OpTemplate of a standard op whose only attrs are its type "T" (`dtype`, a
    tf.DType) and, for a list input, its length "N" (`count`), made once per key."""
    key = (op_type, dtype, count)
    if key not in _SIMPLE:
        attrs = {"T": attr_value_pb2.AttrValue(type=dtype.as_datatype_enum)}
        if count is not None:
            attrs["N"] = attr_value_pb2.AttrValue(i=count)
        _SIMPLE[key] = OpTemplate(op_def_registry.get(op_type), attrs)
    return _SIMPLE[key]


_SIMPLE = {}  # (op type, dtype, count) -> OpTemplate


def _lean_applies(graph, inputs, device):
    """Whether the lean path makes the op _create_op_internal would: `graph` a function
    graph (which no session runs while it is built: no mutation lock), every input in
    it (no capture), none of the graph's scopes that set attrs, colocate, or sit in
    a v1 control-flow context active, and, with a `device`, exactly one device function
    (the emitter's, which gives that device)."""
    if not isinstance(graph, func_graph.FuncGraph) or graph._colocation_stack \
            or graph._attr_scope_map or graph._op_to_kernel_label_map \
            or graph._gradient_override_map or graph._gradient_function_map \
            or graph._container or graph._default_original_op is not None \
            or graph._get_control_flow_context() is not None:
        return False
    if device is not None and len(graph._device_function_stack) != 1:
        return False
    # (an eager tensor has no graph: getattr's default)
    return all(getattr(t, "graph", None) is graph for t in inputs)


def create_op(template: OpTemplate, inputs: Sequence, dtypes: Sequence, name: str,
              device: Optional[str] = None):
    """The op of `template` on `inputs` (graph tensors) in the default graph, named
    `name` (made unique), under the active control dependencies, on `device` (the one
    the emitter's device function gives it, set directly) or, with None, where the
    graph's device functions put it; returns the tf.Operation."""
    graph = ops.get_default_graph()
    if not _lean_applies(graph, inputs, device):
        return graph._create_op_internal(template.op_type, list(inputs), dtypes=dtypes,
                                         attrs=template.attrs, name=name)
    name = graph.unique_name(name)
    control = graph._control_dependencies_for_inputs({t.op for t in inputs}) \
        if graph._control_dependencies_stack else ()
    with graph._c_graph.get() as c_graph:
        desc = c_api.TF_NewOperation(c_graph, template.op_type, name)
    if device:
        c_api.TF_SetDevice(desc, device)
    k = 0
    for length in template.grouping:
        if length is None:
            c_api.TF_AddInput(desc, inputs[k]._as_tf_output())
            k += 1
        else:
            c_api.TF_AddInputList(desc, [t._as_tf_output() for t in inputs[k:k + length]])
            k += length
    for op in control:
        c_api.TF_AddControlInput(desc, op._c_op)
    for key, value in template.serialized:
        c_api.TF_SetAttrValueProto(desc, key, value)
    try:
        c_op = c_api.TF_FinishOperation(desc)
    except errors.InvalidArgumentError as e:  # as _create_c_op converts it
        raise ValueError(e.message) from None
    op = ops.Operation._from_c_op(c_op, graph)
    graph._record_op_seen_by_control_dependencies(op)
    if device is None:
        graph._apply_device_functions(op)
    return op
