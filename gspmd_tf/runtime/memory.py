"""Per-device memory of a lowered SPMD program, read from its local shapes.

Every device runs the same program on local (padded) shapes, so one figure holds for every
device. The peak is an estimate: tensors live from the op that makes them to their last
consumer in program order (TF's executor may run independent ops in another order, and
reuses or aliases some buffers), with arguments, variable shards and outputs live
throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from gspmd_tf.runtime.variables import variable_of_handle


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

    # live ranges in program order; arguments, variables and outputs stay live
    pinned = {r.node for r in program.inputs} | {r.node for r in program.outputs}
    last_use = {}
    for i, node in enumerate(program.nodes):
        for ref in node.inputs:
            last_use[ref.node] = i
    frees = {}
    for i in range(len(program.nodes)):  # a value nothing reads is freed where it is made
        last_use.setdefault(i, i)
    for producer, i in last_use.items():
        frees.setdefault(i, []).append(producer)
    live = peak = arguments + variables + outputs
    timeline = []
    for i, node in enumerate(program.nodes):
        if i not in pinned:
            live += sum(_bytes(s, d) for s, d in zip(node.out_shapes, node.out_dtypes))
        peak = max(peak, live)
        timeline.append(live)
        for producer in frees.get(i, ()):
            if producer not in pinned:
                done = program.nodes[producer]
                live -= sum(_bytes(s, d) for s, d in zip(done.out_shapes, done.out_dtypes))
    return Memory(arguments, variables, outputs, peak, tuple(timeline))
