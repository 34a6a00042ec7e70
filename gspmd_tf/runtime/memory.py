"""Per-device memory of a lowered SPMD program, read from its local shapes.

Every device runs the same program on local (padded) shapes, so one figure holds for every
device. The peak is an estimate: tensors live from the op that makes them to their last
consumer in program order (TF's executor may run independent ops in another order, and
reuses or aliases some buffers), with arguments, variable shards and outputs live
throughout. What a loop keeps alive counts: its body's intermediates while it runs, and
the TensorLists it fills (TF's gradient accumulators: one element per iteration, so a
loop's forward activations for its backward pass) at their full capacity. A loop state
the program returns is the output's buffer from its first value on (e.g. the zeros a
gradient accumulator starts from), not a further buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from gspmd_tf.graph.tensor_lists import LIST_IN_OUT
from gspmd_tf.registry import VIEW, has_trait
from gspmd_tf.runtime.variables import variable_of_handle

_WHILE_OPS = ("While", "StatelessWhile")


@dataclass(frozen=True)
class Memory:
    """Bytes one device holds: `arguments` (its shards of the tensor arguments),
    `variables` (its shards of the captured variables), `outputs` (its output shards) and
    `peak` (estimated live bytes at the fullest point of the program, all included);
    `timeline` the estimated live bytes while each node of the SPMD program runs, in
    program order (the peak is its maximum)."""

    arguments: int
    variables: int
    outputs: int
    peak: int
    timeline: tuple = field(default=(), repr=False, compare=False)

    def text(self):
        """One line per figure."""
        return "\n".join(f"{name:10s} {value:12d} bytes per device" for name, value in
                         (("arguments", self.arguments), ("variables", self.variables),
                          ("outputs", self.outputs), ("peak", self.peak)))


def _bytes(shape, dtype):
    if dtype == tf.resource or dtype == tf.variant:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * tf.as_dtype(dtype).size


def _variable_shape(handle):
    """(global shape, dtype) of the variable behind a captured resource handle: a
    gt.Variable's, else what the handle records (a plain tf.Variable, e.g. of a
    SavedModel); None when unknown."""
    variable = variable_of_handle(handle)
    if variable is not None:
        return tuple(variable.shape), variable.dtype
    data = resource_variable_ops.get_eager_safe_handle_data(handle)
    if not data.is_set or not data.shape_and_type:
        return None
    shape = tf.TensorShape(data.shape_and_type[0].shape)
    if not shape.is_fully_defined():
        return None
    return tuple(shape.as_list()), tf.as_dtype(data.shape_and_type[0].dtype)


def program_memory(lowered):
    """The Memory of `lowered` (a gt.Lowered)."""
    program, graph, mesh = lowered.program.graph, lowered.graph, lowered.mesh
    num_captured = len(graph.captures)
    first_capture = len(graph.inputs) - num_captured
    arguments = variables = 0
    for i, (ref, layout) in enumerate(zip(program.inputs, lowered.program.input_layouts)):
        if program.dtype(ref) != tf.resource:
            arguments += _bytes(program.shape(ref), program.dtype(ref))
            continue
        if i >= first_capture:
            shape_dtype = _variable_shape(graph.captures[i - first_capture])
            if shape_dtype is not None:
                variables += _bytes(layout.local_shape(mesh, shape_dtype[0]), shape_dtype[1])
    outputs = sum(_bytes(program.shape(r), program.dtype(r)) for r in program.outputs)

    held = arguments + variables + outputs  # live throughout
    peak, timeline = _intermediates_peak(program, pinned=True)
    return Memory(arguments, variables, outputs, held + peak,
                  tuple(held + live for live in timeline))


def _value_bytes(graph, node, out):
    """Bytes output `out` of `node` holds; a TensorList a loop returns counts as full (its
    capacity times its element), a list made from a tensor as that tensor."""
    shape, dtype = node.out_shapes[out], node.out_dtypes[out]
    if node.op in _WHILE_OPS and _passed_through(node.regions[1], out):
        return 0  # the operand's own buffer (a captured value TF made a loop value)
    if dtype != tf.variant:
        return _bytes(shape, dtype)
    if node.op == "TensorListFromTensor":
        return _bytes(graph.shape(node.inputs[0]), graph.dtype(node.inputs[0]))
    if node.op in _WHILE_OPS:
        capacity = _list_capacity(graph, node.inputs[out])
        if capacity is not None:
            return capacity[0] * _bytes(shape, capacity[1])
    return 0


def _passed_through(body, k):
    """Whether a loop body returns its parameter k unchanged."""
    result = body.outputs[k]
    while body.nodes[result.node].op == "Identity":
        result = body.nodes[result.node].inputs[0]
    return result == body.inputs[k]


def _list_capacity(graph, ref):
    """(number of elements, element dtype) of the TensorList `ref`, from the op that made
    it (TensorListReserve's num_elements, EmptyTensorList's max_num_elements: TF's
    gradient accumulators get a loop's maximum_iterations), followed back through list
    updates and loops; None when no maker says (e.g. a region parameter)."""
    while True:
        node = graph.nodes[ref.node]
        if node.op in ("EmptyTensorList", "TensorListReserve"):
            size = graph.const_value(node.inputs[1])
            if size is None or size.ndim or size < 0:
                return None
            return int(size), tf.as_dtype(node.attr("element_dtype"))
        if node.op in LIST_IN_OUT:
            ref = node.inputs[LIST_IN_OUT[node.op]]
        elif node.op in _WHILE_OPS:
            ref = node.inputs[ref.out]
        else:
            return None


def _intermediates_peak(graph, pinned):
    """(peak, timeline): the peak bytes of the values `graph` makes, and the live bytes
    while each of its nodes runs, the values live from their op to their last consumer
    in program order. A view (registry VIEW: Identity, Reshape, ...) is its operand's
    buffer, as TF forwards it: it holds no bytes of its own and keeps its operand alive
    as long as it is read. A control-flow op adds its largest region's own peak while it
    runs (a loop body's intermediates of one iteration; what iterations keep for later
    is in the loop's list results); its dense results are its regions' last values, so
    they count only once it has run, its lists (filled as it runs) throughout. pinned:
    the graph's inputs and outputs are counted by the caller (a region's parameters are
    its op's operands, counted in the parent)."""
    buffer = list(range(len(graph.nodes)))  # the node whose buffer each node's value is
    for i, node in enumerate(graph.nodes):
        if _is_view(graph, node):
            buffer[i] = buffer[node.inputs[0].node]
    last_use = {}
    for i, node in enumerate(graph.nodes):
        for ref in node.inputs:
            last_use[buffer[ref.node]] = i
    skip = {r.node for r in graph.inputs}
    if pinned:
        skip |= {buffer[r.node] for r in graph.outputs} | {r.node for r in graph.outputs}
        skip |= _output_loop_inits(graph, buffer, last_use)
    # a loop result passed through unchanged is its operand's buffer: the operand lives
    # as long as the loop's results are read (last loops first: chains of loops)
    for i in reversed(range(len(graph.nodes))):
        node = graph.nodes[i]
        if node.op in _WHILE_OPS and i in last_use:
            for k, ref in enumerate(node.inputs):
                if _passed_through(node.regions[1], k):
                    operand = buffer[ref.node]
                    last_use[operand] = max(last_use.get(operand, operand), last_use[i])
    frees = {}
    for i in range(len(graph.nodes)):  # a value nothing reads is freed where it is made
        frees.setdefault(max(last_use.get(i, i), i), []).append(i)
    sizes = [0 if i in skip or buffer[i] != i else
             sum(_value_bytes(graph, node, k) for k in range(len(node.out_shapes)))
             for i, node in enumerate(graph.nodes)]
    live, timeline = 0, []
    for i, node in enumerate(graph.nodes):
        running = max((_intermediates_peak(region, pinned=False)[0]
                       for region in node.regions), default=0)
        filled = sum(_value_bytes(graph, node, k) for k, dtype in enumerate(node.out_dtypes)
                     if dtype == tf.variant) if running and sizes[i] else 0
        timeline.append(max(live + sizes[i], live + filled + running))
        live += sizes[i]
        for producer in frees.get(i, ()):
            live -= sizes[producer]
    return max(timeline, default=0), timeline


def _output_loop_inits(graph, buffer, last_use):
    """The nodes whose value is the first state of a loop variable the loop returns as a
    graph output (through views), read by nothing after the loop starts: the loop hands
    that state on, iteration by iteration, into the output's buffer, which the caller
    counts throughout (e.g. a gradient accumulator's zeros); counting the initial value
    too would hold the accumulator twice while the loop runs."""
    inits = set()
    for ref in graph.outputs:
        while _is_view(graph, graph.nodes[ref.node]):
            ref = graph.nodes[ref.node].inputs[0]
        loop = graph.nodes[ref.node]
        if loop.op not in _WHILE_OPS:
            continue
        init = buffer[loop.inputs[ref.out].node]
        if (len(graph.nodes[init].out_shapes) == 1 and last_use.get(init) == ref.node
                and sum(buffer[r.node] == init for r in loop.inputs) == 1):
            inits.add(init)
    return inits


def _is_view(graph, node):
    """Whether `node` is a VIEW op whose one dense result has its first operand's bytes
    (TF hands the operand's buffer on)."""
    if not has_trait(node.op, VIEW) or len(node.out_shapes) != 1 or not node.inputs:
        return False
    source = node.inputs[0]
    dtype = node.out_dtypes[0]
    return dtype not in (tf.resource, tf.variant) and graph.dtype(source) == dtype and \
        _bytes(graph.shape(source), dtype) == _bytes(node.out_shapes[0], dtype)
