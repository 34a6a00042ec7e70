"""Cutting an SPMD program into collective-free segments for the XLA backend.

A segment is a set of TF ops that XLA compiles as one computation; the nodes between
segments ("barriers": collectives, gt.Permute, control flow, ops XLA cannot compile) run
op by op. Every node gets a stage: a compute node's stage is the lowest at which all its
inputs are ready (a barrier's result is ready one stage after the barrier's own), a
barrier's the highest stage among its inputs. The program then runs as
    segment 0, barriers of stage 0, segment 1, barriers of stage 1, ...
so the number of segments is the length of the longest chain of barriers, and every
compute node runs in the first segment where it can: independent collectives of one
stage (the combiner's merged all-reduces, the gradient all-reduces of a layer) cut the
program once, not once each. See docs/INTERNALS.md, "XLA backend".
"""

from __future__ import annotations

import hashlib

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from gspmd_tf.backends import base

# gt.* nodes a segment reads but never holds: emitted first, once per device
SOURCES = (base.INPUT, base.SHARD_INDEX)
# Values XLA computes differently from TF's kernels (random bits): kept op by op so that
# both backends give the same numbers.
_RANDOM_WORDS = ("Random", "Multinomial", "TruncatedNormal")
_UNCOMPILABLE_DTYPES = (tf.string, tf.resource, tf.variant)


class Segment:
    """Nodes compiled together: `nodes` (program indices, program order), `inputs` (Refs
    read from outside, in first-use order) and `outputs` (Refs used outside, sorted)."""

    def __init__(self, nodes, inputs, outputs):
        self.nodes = nodes
        self.inputs = inputs
        self.outputs = outputs

    def __repr__(self):
        return f"<Segment of {len(self.nodes)} nodes, {len(self.inputs)} in, " \
               f"{len(self.outputs)} out>"


def why_not_compiled(node):
    """Why `node` must run op by op, or None when XLA may compile it (a check of what the
    program says; XLA's own verdict comes from compiling, see xla.py)."""
    if node.op.startswith("gt."):
        return "a gspmd-tf collective or device op"
    if node.regions:
        return "control flow with regions"
    if any(word in node.op for word in _RANDOM_WORDS):
        return "a random op (XLA draws other numbers than TF's kernel)"
    if any(d in _UNCOMPILABLE_DTYPES for d in node.out_dtypes):
        return "its outputs are strings, resources or variants"
    if any(s is None or any(x is None or x < 0 for x in s) for s in node.out_shapes):
        return "its output shape depends on the data"
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        return "an op TF does not register"
    if op_def.is_stateful and not any(a.type == tf.resource.as_datatype_enum
                                      for a in op_def.input_arg):
        return "a stateful op that touches no variable"
    return None


def cut(program, excluded=frozenset()):
    """The program as steps in run order: Segments and node indices (run op by op).

    `excluded`: node indices to run op by op besides those why_not_compiled names.
    Sources (gt.Input, gt.ShardIndex) come first. Stateful nodes keep their program
    order: a stateful node is never in an earlier stage than the stateful node before
    it, and never in the same stage before a stateful barrier that precedes it.
    """
    nodes = program.nodes
    kind = []  # "source" | "barrier" | "compute"
    for i, node in enumerate(nodes):
        if node.op in SOURCES:
            kind.append("source")
        elif i in excluded or why_not_compiled(node) is not None:
            kind.append("barrier")
        else:
            kind.append("compute")
    stage = [0] * len(nodes)
    last_stateful = None
    for i, node in enumerate(nodes):
        if kind[i] == "source":
            continue
        producers = [ref.node for ref in node.inputs] + list(node.control_inputs)
        if _is_stateful(node) and last_stateful is not None:
            producers.append(last_stateful)
        ready = 0
        for p in producers:
            if kind[p] == "source":
                continue
            # a compute node must wait for the stage after a barrier it reads; a barrier
            # runs after the segment of its stage and after earlier barriers of it
            late = kind[i] == "compute" and kind[p] == "barrier"
            ready = max(ready, stage[p] + late)
        stage[i] = ready
        if _is_stateful(node):
            last_stateful = i
    readers = [set() for _ in nodes]  # readers[i]: the nodes reading an output of node i
    for i, node in enumerate(nodes):
        for ref in node.inputs:
            readers[ref.node].add(i)
    computes, barriers = {}, {}  # stage -> node indices, in program order
    for i in range(len(nodes)):
        if kind[i] != "source":
            (computes if kind[i] == "compute" else barriers).setdefault(stage[i], []).append(i)
    steps = [i for i in range(len(nodes)) if kind[i] == "source"]
    for s in range(max(stage, default=0) + 1):
        if s in computes:
            steps.append(_segment(program, computes[s], readers))
        steps += barriers.get(s, [])
    return steps


def _is_stateful(node):
    op_def = op_def_registry.get(node.op)
    return bool(op_def is not None and op_def.is_stateful)


def _segment(program, members, readers):
    inside = set(members)
    inputs, seen = [], set()
    for i in members:
        for ref in program.nodes[i].inputs:
            if ref.node not in inside and ref not in seen:
                seen.add(ref)
                inputs.append(ref)
    outputs = {ref for ref in program.outputs if ref.node in inside}
    for i in members:
        for reader in readers[i] - inside:
            outputs.update(ref for ref in program.nodes[reader].inputs if ref.node == i)
    return Segment(members, inputs, sorted(outputs))


def segment_key(program, segment, device_type):
    """A digest of everything the compiled segment depends on: each node's op, attrs
    (underscore attrs aside), inputs (as positions within the segment), control inputs,
    shapes and dtypes, and the outputs; not node names. Identical layers of a model give
    identical keys, so XLA compiles their segment once."""
    position = {i: k for k, i in enumerate(segment.nodes)}
    argument = {ref: k for k, ref in enumerate(segment.inputs)}

    def where(ref):
        return ("arg", argument[ref]) if ref in argument else \
            ("node", position[ref.node], ref.out)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((device_type, [(program.shape(r), program.dtype(r).name)
                                      for r in segment.inputs])).encode())
    for i in segment.nodes:
        node = program.nodes[i]
        attrs = sorted((k, v.SerializeToString(deterministic=True))
                       for k, v in node.attrs.items() if not k.startswith("_"))
        digest.update(repr((
            node.op, attrs, [where(r) for r in node.inputs],
            [position.get(c) for c in node.control_inputs], node.out_shapes,
            [d.name for d in node.out_dtypes])).encode())
    digest.update(repr([where(r) for r in segment.outputs]).encode())
    return digest.hexdigest()

