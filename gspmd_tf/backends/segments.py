"""Cutting an SPMD program into collective-free segments for the XLA backend.

A segment is a set of TF ops that XLA compiles as one computation; the nodes between
segments ("barriers": collectives, gt.Permute, control flow, variable reads and stateful
ops other than variable writes, ops XLA cannot compile) run op by op. Every node gets a
stage: a compute node's stage is the lowest at which all its inputs are ready (a
barrier's result is ready one stage after the barrier's own), a barrier's the highest
stage among its inputs. The program then runs as
    segment 0, barriers of stage 0, segment 1, barriers of stage 1, ...
so the number of segments is the length of the longest chain of barriers, and every
compute node runs in the first segment where it can: independent collectives of one
stage (the combiner's merged all-reduces, the gradient all-reduces of a layer) cut the
program once, not once each. Variable writes and the arithmetic only they use (an
optimizer's update, a moving average) form a stage's update segment, run after its
main segment on the variables' own device; the main segments stay pure functions of
tensors. See docs/DESIGN_LOG.md, "XLA backend".
"""

from __future__ import annotations

import hashlib

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from gspmd_tf.backends import base
from gspmd_tf.registry import (ASSIGNS_VARIABLE, has_trait, is_stateful, op_def,
                               xla_form, xla_numerics_differ)

# gt.* nodes a segment reads but never holds: emitted first, once per device
SOURCES = (base.INPUT, base.SHARD_INDEX)
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


# Variable writes (registry trait ASSIGNS_VARIABLE), which XLA compiles with the
# arithmetic computing their values: the variable is an argument of the (update)
# segment. Reads stay op by op: a
# ReadVariableOp hands out the variable's buffer without a copy, where a compiled read
# would copy it, and it would tie the segment reading it to the variable's device
# (xla.py). Other ops on resources (TensorArrays, hash tables, stateful random
# generators) stay barriers.
def why_not_compiled(program, node):
    """Why `node` of `program` must run op by op, or None when XLA may compile it (what
    the program says; XLA's own verdict comes from its bridge, see xla.py)."""
    if node.op.startswith("gt."):
        return "a gspmd-tf collective or device op"
    if node.regions:
        return "control flow with regions"
    if any(d in _UNCOMPILABLE_DTYPES for d in node.out_dtypes):
        return "its outputs are strings, resources or variants"
    handles = 1 if has_trait(node.op, ASSIGNS_VARIABLE) else 0  # a variable's handle comes first
    if any(program.dtype(ref) in _UNCOMPILABLE_DTYPES for ref in node.inputs[handles:]):
        return "it reads strings, resources or variants"
    if handles and program.nodes[node.inputs[0].node].op != base.INPUT:
        # a segment then holds one argument per variable, never two aliases of one
        # (through resource Identity ops)
        return "it reaches its variable through another op than the program's input"
    operand = program.dtype(node.inputs[0]) if node.inputs else None
    numerics = xla_numerics_differ(node, operand)
    if numerics is not None and xla_form(node, operand) is None:
        return numerics
    if any(s is None or any(x is None or x < 0 for x in s) for s in node.out_shapes):
        return "its output shape depends on the data"
    if op_def_registry.get(node.op) is None:
        return "an op TF does not register"
    if is_stateful(node.op) and not has_trait(node.op, ASSIGNS_VARIABLE):
        return "a stateful op"
    return None


def large_dots(program, min_flops):
    """Indices of the top-level nodes of `program` doing at least `min_flops`
    multiply-adds (dots and convolutions: registry.multiply_adds)."""
    return {i for i, count in dot_multiply_adds(program).items() if count >= min_flops}


def dot_multiply_adds(program):
    """{node index: multiply-adds} of the top-level dot-like nodes of `program` (those
    whose entry counts multiply-adds: dots and convolutions)."""
    return {i: base.node_multiply_adds(program, node)
            for i, node in enumerate(program.nodes)
            if op_def(node.op).multiply_adds is not None}


def cut(program, excluded=frozenset(), shared=None):
    """The program as steps in run order: Segments and node indices (run op by op).

    `excluded`: node indices to run op by op besides those why_not_compiled names.
    Sources (gt.Input, gt.ShardIndex) come first, then the constants a barrier or the
    program's outputs read; a segment holds its own copy of every constant it reads
    (Const nodes and pure ops of constants only), so that XLA sees shapes and axes as
    compile-time constants, not arguments. Stateful nodes keep their program order per
    resource, as TF's automatic control dependencies do: none is in an earlier stage
    than the node before it that touches one of its variables (stateful nodes touching
    none: than the one before it of those), a compiled write not in the stage of a
    barrier before it; within a segment the segment's function orders them (automatic
    control dependencies again), and a barrier runs after its stage's segments.
    A stage's compute splits into its main segment and, after it, its update segment:
    the variable writes and the compute nodes all of whose dependents (data and control)
    are in the update segment.

    `shared` (node index -> a hashable naming the devices whose values of it are equal,
    for the nodes some device reads from another: xla.py) keeps such nodes out of update
    segments, which run on every variable's device: between a stage's main and update
    segments, its shared nodes all of whose dependents come after the main segment
    (not program outputs) form one segment per pattern of equal devices, which the
    backend calls once per class of devices (an optimizer's update arithmetic on
    replicated weights). The segments of a stage then run as main, shared (dependencies
    first), update; an update segment left with writes only is run op by op instead.
    """
    nodes = program.nodes
    kind = []  # "source" | "constant" | "barrier" | "compute"
    for i, node in enumerate(nodes):
        if node.op in SOURCES:
            kind.append("source")
        elif i in excluded or why_not_compiled(program, node) is not None:
            kind.append("barrier")
        elif not node.control_inputs and all(kind[r.node] == "constant"
                                             for r in node.inputs):
            kind.append("constant")  # a Const, or a pure op of constants only
        else:
            kind.append("compute")
    stage = [0] * len(nodes)
    last_stateful = {}  # resource (or None: stateful ops without one) -> its last node
    for i, node in enumerate(nodes):
        if kind[i] in ("source", "constant"):
            continue
        producers = [ref.node for ref in node.inputs] + list(node.control_inputs)
        if is_stateful(node.op):
            for resource in _resources(program, node) or [None]:
                if resource in last_stateful:
                    producers.append(last_stateful[resource])
                last_stateful[resource] = i
        ready = 0
        for p in producers:
            if kind[p] in ("source", "constant"):
                continue
            # a compute node must wait for the stage after a barrier it reads; a barrier
            # runs after the segment of its stage and after earlier barriers of it
            late = kind[i] == "compute" and kind[p] == "barrier"
            ready = max(ready, stage[p] + late)
        stage[i] = ready
    readers = [set() for _ in nodes]  # readers[i]: the nodes reading an output of node i
    dependents = [set() for _ in nodes]  # readers and nodes with a control input on it
    for i, node in enumerate(nodes):
        for ref in node.inputs:
            readers[ref.node].add(i)
            dependents[ref.node].add(i)
        for c in node.control_inputs:
            dependents[c].add(i)
    outputs = {ref.node for ref in program.outputs}
    computes, barriers = {}, {}  # stage -> node indices, in program order
    for i in range(len(nodes)):
        if kind[i] in ("compute", "barrier"):
            (computes if kind[i] == "compute" else barriers).setdefault(stage[i], []).append(i)
    staged = []  # the steps after sources and constants
    shared = shared or {}
    for s in range(max(stage, default=0) + 1):
        here = set(computes.get(s, []))
        update, tail = set(), set()  # tail: shared nodes run after the main segment
        for i in reversed(computes.get(s, [])):  # dependents come later in program order
            if has_trait(nodes[i].op, ASSIGNS_VARIABLE):
                update.add(i)
            elif not dependents[i] or i in outputs:
                continue
            elif i not in shared and dependents[i] <= update:
                update.add(i)
            elif i in shared and all(r in update or r in tail or r not in here
                                     for r in dependents[i]):
                tail.add(i)
        main = [i for i in computes.get(s, []) if i not in update and i not in tail]
        # with `shared`, an update segment of writes only (their values computed once,
        # before) runs op by op in its place: compiled, it would fuse nothing and
        # compile once per device (RESULTS §14.9)
        plain = sorted(update) if shared and all(has_trait(nodes[i].op, ASSIGNS_VARIABLE)
                                                 for i in update) else []
        for i in plain:
            kind[i] = "barrier"
        for part in _by_pattern(main, sorted(tail), shared, dependents) + [
                sorted(update.difference(plain))]:
            if part:
                staged.append(_segment(program, part, readers, kind))
        staged += plain + barriers.get(s, [])
    # constants barriers or outputs read, and the constants those read: emitted op by op
    needed = {i for i in range(len(nodes)) if kind[i] == "constant" and any(
        kind[r] == "barrier" for r in readers[i])}
    needed |= {ref.node for ref in program.outputs if kind[ref.node] == "constant"}
    pending = list(needed)
    while pending:
        for ref in nodes[pending.pop()].inputs:
            if ref.node not in needed:
                needed.add(ref.node)
                pending.append(ref.node)
    steps = [i for i in range(len(nodes)) if kind[i] == "source"]
    return steps + sorted(needed) + staged


def _by_pattern(main, tail, shared, dependents):
    """The main nodes and the `tail` (node indices, program order) as lists of nodes to
    compile together, in run order: main first, each tail pattern (shared[]) on its own,
    a list before those with a node depending on its nodes. A main list of one pattern
    takes that pattern's tail nodes. [main, tail] when the dependencies between the
    lists form a cycle (no order of them would serve)."""
    patterns = {shared.get(i) for i in main}
    key = patterns.pop() if len(patterns) == 1 and None not in patterns else None
    groups = {key: list(main)} if main else {}  # pattern (None: the main nodes) -> nodes
    for i in tail:
        groups.setdefault(shared[i], []).append(i)
    pattern = {i: p for p, members in groups.items() for i in members}
    later = {p: set() for p in groups}  # pattern -> patterns depending on its nodes
    for p, members in groups.items():
        for i in members:
            later[p].update(pattern[r] for r in dependents[i] if r in pattern)
        later[p].discard(p)
    waiting = dict.fromkeys(groups, 0)
    for p in groups:
        for q in later[p]:
            waiting[q] += 1
    ready = [p for p in groups if not waiting[p]]
    ordered = []
    while ready:
        p = ready.pop(0)
        ordered.append(sorted(groups[p]))
        for q in later[p]:
            waiting[q] -= 1
            if not waiting[q]:
                ready.append(q)
    return ordered if len(ordered) == len(groups) else [main, tail]


def _resources(program, node):
    """The variables `node` touches: the Refs its resource inputs come from, through
    Identity ops."""
    out = []
    for ref in node.inputs:
        if program.dtype(ref) != tf.resource:
            continue
        while program.nodes[ref.node].op == "Identity" and program.nodes[ref.node].inputs:
            ref = program.nodes[ref.node].inputs[0]
        out.append(ref)
    return out


def _segment(program, computes, readers, kind):
    """The Segment of `computes` and copies of the constants they read."""
    members = set(computes)
    pending = list(computes)
    while pending:  # the constants read, and the constants those read
        for ref in program.nodes[pending.pop()].inputs:
            if kind[ref.node] == "constant" and ref.node not in members:
                members.add(ref.node)
                pending.append(ref.node)
    inputs, seen = [], set()
    for i in sorted(members):
        for ref in program.nodes[i].inputs:
            if ref.node not in members and ref not in seen:
                seen.add(ref)
                inputs.append(ref)
    inside = set(computes)  # a constant read outside is emitted there on its own
    outputs = {ref for ref in program.outputs if ref.node in inside}
    for i in computes:
        for reader in readers[i] - inside:
            outputs.update(ref for ref in program.nodes[reader].inputs if ref.node == i)
    return Segment(sorted(members), inputs, sorted(outputs))


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

