"""Per-device memory of a lowered SPMD program, read from its local shapes.

Every device runs the same program on local (padded) shapes, so one figure holds for every
device. The peak is an estimate: tensors live from the op that makes them to their last
consumer in program order (TF's executor may run independent ops in another order, and
reuses or aliases some buffers), with arguments, variable shards and outputs live
throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from gspmd_tf.runtime.variables import variable_of_handle


@dataclass(frozen=True)
class Memory:
    """Bytes one device holds: `arguments` (its shards of the tensor arguments),
    `variables` (its shards of captured gt.Variables), `outputs` (its output shards) and
    `peak` (estimated live bytes at the fullest point of the program, all included)."""

    arguments: int
    variables: int
    outputs: int
    peak: int

    def text(self):
        """One line per figure."""
        return "\n".join(f"{name:10s} {value:12d} bytes per device" for name, value in
                         (("arguments", self.arguments), ("variables", self.variables),
                          ("outputs", self.outputs), ("peak", self.peak)))


def _bytes(shape, dtype):
    if dtype == tf.resource or dtype == tf.variant:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * tf.as_dtype(dtype).size


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
        variable = (variable_of_handle(graph.captures[i - first_capture])
                    if i >= first_capture else None)
        if variable is not None:
            shape = layout.local_shape(mesh, tuple(variable.shape))
            variables += _bytes(shape, variable.dtype)
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
    for i, node in enumerate(program.nodes):
        if i not in pinned:
            live += sum(_bytes(s, d) for s, d in zip(node.out_shapes, node.out_dtypes))
        peak = max(peak, live)
        for producer in frees.get(i, ()):
            if producer not in pinned:
                done = program.nodes[producer]
                live -= sum(_bytes(s, d) for s, d in zip(done.out_shapes, done.out_dtypes))
    return Memory(arguments, variables, outputs, peak)
