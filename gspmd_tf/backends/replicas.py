"""Which devices hold the same value of each SPMD program tensor, so that the local
backend can compute a replicated value once and let the other devices read it.

An SPMD program computes a replicated tensor on every device that holds it: a
data-parallel optimizer update, for one, runs on every device on the same summed
gradient and the same weights. Between CPU devices of one process a read of another
device's tensor costs nothing (TF hands the buffer over), so the local backend runs such
an op on one device of each group of devices holding equal values and the others read
its result (docs/DESIGN_LOG.md, "Backends").

`replica_classes` finds those groups by following values, not layouts: a device's
value of a node is equal to another's when the node is a deterministic function of
inputs that are equal on both. Only program inputs are judged by their layouts (devices
holding the same block of an input's layout hold equal shards, what a layout means);
gt.ShardIndex and the collectives by what they compute on each device.
"""

from __future__ import annotations

from gspmd_tf.backends import base
from gspmd_tf.backends.tf_kernels import on_cpu
from gspmd_tf.registry import PRINTS, READS_VARIABLE, has_trait, is_stateful


def cpu_devices(mesh):
    """The CPU devices of `mesh` in this process, in device order: those whose tensors
    the others read in place, and the devices that share one copy of a variable's
    block (copy_owners)."""
    return tuple(d for d in mesh.addressable_ids if on_cpu(mesh.devices[d]))


def copy_owners(mesh, layout):
    """owners[d]: the device whose tf.Variable holds device d's shard of a gt.Variable
    of `layout`: the first CPU device of this process holding the same block, the class
    replica_classes gives a program input of that layout (d itself on any other
    device; None on other workers' devices). One copy per class, not per device:
    a data-parallel model's replicated variables were one tf.Variable and one write
    per device (2,120 of each for MobileNetV2 on 8 devices)."""
    owners = [None] * mesh.size
    for d in mesh.addressable_ids:
        owners[d] = d
    first = {}
    for d in cpu_devices(mesh):
        owners[d] = first.setdefault(_block(mesh, layout, d), d)
    return owners


def replica_classes(program, mesh, local):
    """classes[i][d]: for node i of `program` (a top-level SPMD program) and device id d
    of `local` (this process's devices), the first device of `local` whose value of
    every output of node i equals d's (d itself when none before it is known equal);
    None for devices not in `local`."""
    n = mesh.size
    classes = []
    for node in program.nodes:
        keys = _keys(node, mesh, local, classes)
        first = {}
        row = [None] * n
        for d in local:
            row[d] = d if keys[d] is None else first.setdefault(keys[d], d)
        classes.append(tuple(row))
    return classes


def runs_once(node):
    """Whether node may run on one device of a class for all of them: a pure TF op (no
    state, no function bodies, no resources or variants) that computes something, or a
    variable read (READS_VARIABLE: it only reads). A read runs on the class's first
    device s, ordered with s's writes, for devices whose copies of the variable hold
    what s's does at that point: equal blocks of its layout at the start, and every
    write of the program applied to each copy with a value of one class (what the
    classes already assume of the reads' results); the devices of a class share one
    copy of the variable, on s (copy_owners), whose writes run on s too
    (emitter.DeviceEmitter._variable_writes). A data-parallel step read each of its
    replicated variables on every device: 3,400 of MobileNetV2's 19,762 emitted ops on
    8 devices, 425 now. A PRINTS op (tf.print) runs once per class too: what a user
    prints is printed once per call, not once per device holding it.
    Constants and identities run on every device: they cost nothing there, and a read of
    another device's result adds a _Send/_Recv pair (~5 us each in the LM step's
    profile). Small values run once too: on the LM and ResNet50 train steps thresholds
    of 256 to 65536 elements measured no better than none (benchmarks/RESULTS.md
    §14.7)."""
    if has_trait(node.op, PRINTS):
        return True  # printed once for the devices holding its inputs equal
    if node.op.startswith("gt.") or node.regions or not node.out_shapes or \
            node.op in ("Const", "Identity"):
        return False
    if is_stateful(node.op) and not has_trait(node.op, READS_VARIABLE):
        return False
    return not any(d.name in ("resource", "variant") for d in node.out_dtypes)


def _keys(node, mesh, local, classes):
    """keys[d]: a hashable that is equal for two devices exactly when node's values on
    them are known equal, or None (d's value known equal to no other)."""
    n = mesh.size
    keys = [None] * n
    ins = [classes[ref.node] for ref in node.inputs]
    p = node.params
    if node.op == base.INPUT:
        layout = p.get("layout")
        if layout is not None:
            for d in local:
                keys[d] = _block(mesh, layout, d)
        return keys
    if node.op == base.SHARD_INDEX:
        for d in local:
            keys[d] = mesh.shard_index(d, p["axes"])
        return keys
    if node.op in (base.ALL_REDUCE, base.ALL_GATHER, base.REDUCE_SCATTER, base.ALL_TO_ALL):
        groups = mesh.groups(tuple(p["axes"]))
        for row in groups:
            row = [int(m) for m in row]
            if not all(m in local for m in row):
                continue
            members = tuple(ins[0][m] for m in row)
            for position, d in enumerate(row):
                # an all-reduce and an all-gather give every member the same result
                keys[d] = members if node.op in (base.ALL_REDUCE, base.ALL_GATHER) \
                    else (members, position)
        return keys
    if node.op == base.PERMUTE:
        source_of = {int(t): int(s) for s, t in p["pairs"]}
        for d in local:
            s = source_of.get(d)
            keys[d] = "zeros" if s is None else (ins[0][s] if s in local else None)
        return keys
    if node.op.startswith("gt.") or node.regions:
        return keys  # a body may read its device's shard index: never assumed equal
    # a variable read is a function of its input values (the variable's, through its
    # handle): equal handles of replicated variables give equal values (runs_once: the
    # read runs on one device of the class, ordered with that device's writes)
    if is_stateful(node.op) and not (has_trait(node.op, READS_VARIABLE)
                                     or has_trait(node.op, PRINTS)):
        return keys
    for d in local:
        keys[d] = tuple(row[d] for row in ins)
    return keys


def _block(mesh, layout, d):
    """Which block of `layout` device d holds: its shard index along each dim's axes
    and along the axes of a pending reduction."""
    return tuple(mesh.shard_index(d, axes) for axes in layout.dims) + (
        mesh.shard_index(d, layout.partial),)
