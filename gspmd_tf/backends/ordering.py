"""The order of an SPMD program's stateful nodes on each device, read from the program.

tf.function's automatic control dependencies (ACD, auto_control_deps.py) find that order
by inspecting every op of the traced graph: the local backend's per-device graph is the
program's nodes times the devices (~21,000 ops for the 64-layer FFN train step), most of
them pure, and ACD was ~25% of building it. The program knows which nodes touch state,
and every device runs the same program on its own variable handles, so the order is
found once per program, over its few stateful nodes, and the backend adds the same
edges on every device (backends/emitter.py). The rules are ACD's, applied to nodes:

- a node with resource inputs (a variable's handle; an Identity of a handle is the
  same resource, as ACD resolves it) reads it when its op is one TF registers as
  read-only (ReadVariableOp, ResourceGather, ...), else writes it; a read comes after
  the resource's last write, a write after its last write and every read since;
- a stateful op without resource inputs comes after the previous such op (TF's one
  chain; here one per device, as every device runs its own copy of the program);
- a stateful op must run (a control output of the function) unless it is a read no
  node uses.

Collectives are not decided here: a collective node is emitted as TF's collective ops
(taking the device's ordering token, a resource) or as pure copies, which only the
lowering knows; the lowering chains the token users of a device itself.
"""

from __future__ import annotations

from collections import namedtuple

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps as acd
from tensorflow.python.framework import auto_control_deps_utils as acd_utils

from gspmd_tf.registry import is_stateful

Ordering = namedtuple("Ordering", "after must_run")
Ordering.__doc__ = """The order of a program's stateful nodes: `after[i]` the nodes node i
comes after (indices; only for nodes that have any), `must_run` the nodes that run even
when no output needs them."""


def stateful(op_type):
    """Whether ACD treats ops of `op_type` as stateful (ordered, must run): the stateful
    ops (registry.is_stateful: an op TF does not know counts as one) but ACD's lists of
    asynchronous collectives, legacy random ops and skipped ones."""
    return (is_stateful(op_type) and op_type not in acd.ASYNC_STATEFUL_OPS and
            op_type not in acd.LEGACY_RANDOM_OPS and
            op_type not in acd.SKIPPED_ORDER_INSENSITIVE_STATEFUL_OPS)


def program_ordering(program, order):
    """The Ordering of `program`'s top-level nodes, taken in emission order `order`
    (node indices; stateful nodes keep their program order in it, schedule.py)."""
    nodes = program.nodes
    used = {ref.node for node in nodes for ref in node.inputs}
    used.update(ref.node for ref in program.outputs)
    last_write, reads = {}, {}  # resource (its root Ref) -> node index; -> [node index]
    last_stateful = None
    after, must_run = {}, set()
    for index in order:
        node = nodes[index]
        if node.op.startswith("gt."):
            continue  # collectives: see the module docstring
        resources = {_root(program, ref) for ref in node.inputs
                     if program.dtype(ref) == tf.resource}
        if node.op == "Identity":
            continue  # passes a handle on: not an access (ACD resolves it the same way)
        is_stateful = stateful(node.op)
        if not resources and not is_stateful:
            continue
        before = set()
        read_only = node.op in acd_utils.RESOURCE_READ_OPS
        for resource in resources:
            if resource in last_write:
                before.add(last_write[resource])
            if read_only:
                reads.setdefault(resource, []).append(index)
            else:
                before.update(reads.pop(resource, ()))
                last_write[resource] = index
        if is_stateful and not resources:
            if last_stateful is not None:
                before.add(last_stateful)
            last_stateful = index
        if is_stateful and (not read_only or index in used):
            must_run.add(index)
        if before:
            after[index] = tuple(sorted(before))
    return Ordering(after, frozenset(must_run))


def _root(program, ref):
    """The tensor a resource handle `ref` passes on through Identity nodes."""
    node = program.nodes[ref.node]
    while node.op == "Identity":
        ref = node.inputs[0]
        node = program.nodes[ref.node]
    return ref
