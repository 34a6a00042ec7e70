"""gt.function: trace, import, propagate, partition, lower and run a TF function."""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.importer import import_graph
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import PartitionSpec
from gspmd_tf.propagation.propagate import propagate
from gspmd_tf.runtime.lowered import Lowered
from gspmd_tf.runtime.sharded_tensor import ShardedTensor, split_value
from gspmd_tf.runtime.variables import variable_of_handle
from gspmd_tf.spmd.partitioner import partition


def _default_backend(mesh):
    from gspmd_tf.backends.local import LocalBackend
    return LocalBackend(mesh)


def function(fn=None, *, mesh, in_shardings=None, out_shardings=None, backend=None):
    """Partition `fn` over `mesh`; usable as `@gt.function(mesh=...)` or `gt.function(f, ...)`.

    in_shardings: one entry per positional argument (a PartitionSpec, a gt.Sharding, or
    None to infer); out_shardings: one per flat output, likewise. Calls return
    ShardedTensors in the structure `fn` returns.
    """
    if fn is None:
        return functools.partial(function, mesh=mesh, in_shardings=in_shardings,
                                 out_shardings=out_shardings, backend=backend)
    return Function(fn, mesh, in_shardings, out_shardings, backend or _default_backend)


def _spec_layout(mesh, entry, rank, what):
    """An in/out sharding entry as a Layout (None stays None)."""
    from gspmd_tf.sharding import Sharding
    if entry is None:
        return None
    if isinstance(entry, Sharding):
        return entry.to_layout(mesh, rank, what)
    if isinstance(entry, (PartitionSpec, tuple, list)):
        return Layout.from_spec(mesh, PartitionSpec(*entry), rank, what)
    raise ShardingError(f"{what}: expected a PartitionSpec, gt.Sharding or None, got {entry!r}")


class Function:
    """A partitioned function: lowered once per input signature, then run."""

    def __init__(self, fn, mesh, in_shardings, out_shardings, backend_factory):
        self.fn = fn
        self.mesh = mesh
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self._backend_factory = backend_factory
        self._traced = tf.function(fn, autograph=False)
        self._cache = {}
        functools.update_wrapper(self, fn)

    # ----------------------------------------------------------------- signature
    def _flat_args(self, args):
        if self.in_shardings is not None and len(self.in_shardings) != len(args):
            raise ShardingError(
                f"{self.fn.__name__} got {len(args)} arguments but in_shardings has "
                f"{len(self.in_shardings)} entries: pass one entry per positional argument")
        flat, entries = [], []
        for i, arg in enumerate(args):
            leaves = tf.nest.flatten(arg)
            entry = None if self.in_shardings is None else self.in_shardings[i]
            for leaf in leaves:
                flat.append(leaf)
                entries.append(entry)
        return flat, entries

    def _spec_of(self, leaf):
        if isinstance(leaf, ShardedTensor):
            if leaf.mesh != self.mesh:
                raise ShardingError(f"argument {leaf!r} lives on another mesh; move it to "
                                    f"{self.mesh!r} first")
            return tf.TensorSpec(leaf.shape, leaf.dtype)
        if isinstance(leaf, tf.TensorSpec):
            return leaf
        value = leaf if isinstance(leaf, tf.Tensor) else tf.convert_to_tensor(leaf)
        return tf.TensorSpec(value.shape, value.dtype)

    def lower(self, *args):
        """Lower for these arguments (values or tf.TensorSpec); nothing runs."""
        return self._lower(args)[0]

    def _lower(self, args):
        flat, entries = self._flat_args(args)
        specs = [self._spec_of(leaf) for leaf in flat]
        committed = [leaf.layout if isinstance(leaf, ShardedTensor) else None for leaf in flat]
        # an argument's own layout matters only where in_shardings leaves it open
        key = tuple((tuple(s.shape), s.dtype, str(e) if e is not None else c)
                    for s, e, c in zip(specs, entries, committed))
        if key not in self._cache:
            self._cache[key] = self._build(args, flat, specs, entries, committed)
        return self._cache[key], flat

    def _build(self, args, flat, specs, entries, committed):
        structured = tf.nest.pack_sequence_as(list(args), specs)
        concrete = self._traced.get_concrete_function(*structured)
        graph = import_graph(concrete)
        mesh = self.mesh
        seeds = {}
        for i, (ref, spec) in enumerate(zip(graph.inputs, specs)):
            what = f"argument {i} ({graph.tensor_name(ref)})"
            layout = _spec_layout(mesh, entries[i], len(spec.shape), what) or committed[i]
            if layout is not None:
                seeds[ref] = layout
        for ref, value in zip(graph.inputs[len(flat):], graph.captures):
            if graph.dtype(ref) == tf.resource:
                seeds[ref] = self._variable_layout(graph, ref,
                                                   _captured_variable(graph, ref, value))
        self._seed_annotations(graph, seeds)
        out_layouts = self._seed_outputs(graph, seeds)
        propagation = propagate(graph, mesh, seeds)
        out_layouts = [l or propagation.layout(r) for l, r in zip(out_layouts, graph.outputs)]
        program = partition(graph, mesh, propagation, out_layouts)
        lowered = Lowered(mesh, graph, propagation, program, len(flat), set(seeds),
                          self._backend_factory)
        lowered.structured_outputs = concrete.structured_outputs
        return lowered

    def _variable_layout(self, graph, ref, variable):
        """The layout captured gt.Variable `variable` enters the program with: its own on
        its own mesh. From another mesh it is read-only (updates would have to reach
        shards this program does not hold): its value enters resharded to its spec on
        this mesh, or replicated where this mesh lacks the spec's axes."""
        if variable.mesh == self.mesh:
            return variable.layout
        writer = _first_writer(graph, ref)
        if writer is not None:
            raise ShardingError(
                f"{self.fn.__name__} updates variable {variable.name!r} ({writer.op} "
                f"{writer.name!r}) but runs on {_mesh_text(self.mesh)} while the variable "
                f"lives on {_mesh_text(variable.mesh)}: run the function on the "
                "variable's mesh, or make the variable on this mesh (e.g. gt.Variable("
                "v.numpy(), mesh, spec)); reading a variable of another mesh works")
        try:
            return Layout.from_spec(self.mesh, variable.spec, len(variable.shape))
        except ShardingError:
            return Layout.replicated(len(variable.shape))

    def _seed_annotations(self, graph, seeds):
        from gspmd_tf.sharding import Sharding
        for ref, proto in graph.annotations.items():
            name = graph.tensor_name(ref)
            layout = Sharding.from_proto(proto).to_layout(
                self.mesh, len(graph.shape(ref)), f"tensor {name!r}")
            _add_seed(graph, seeds, ref, layout, f"annotation on {name!r}")

    def _seed_outputs(self, graph, seeds):
        if self.out_shardings is None:
            return [None] * len(graph.outputs)
        if len(self.out_shardings) != len(graph.outputs):
            raise ShardingError(
                f"{self.fn.__name__} has {len(graph.outputs)} outputs but out_shardings has "
                f"{len(self.out_shardings)} entries: give one per flat output")
        layouts = []
        for i, (ref, entry) in enumerate(zip(graph.outputs, self.out_shardings)):
            layout = _spec_layout(self.mesh, entry, len(graph.shape(ref)), f"output {i}")
            if layout is not None:
                _add_seed(graph, seeds, ref, layout, f"out_shardings[{i}]")
            layouts.append(layout)
        return layouts

    # ----------------------------------------------------------------- running
    def __call__(self, *args):
        lowered, flat = self._lower(args)
        run = lowered.compile()
        program = lowered.program
        graph = lowered.graph
        copies = []  # read-only copies of variables of other meshes, alive for the run
        inputs = [self._shards(value, layout, copies) for value, layout in
                  zip(list(flat) + list(graph.captures), program.input_layouts)]
        outs = run(inputs)
        del copies
        results = [ShardedTensor(self.mesh, layout, lowered.graph.shape(ref),
                                 lowered.graph.dtype(ref), shards)
                   for ref, layout, shards in zip(lowered.graph.outputs,
                                                  program.output_layouts, outs)]
        return tf.nest.pack_sequence_as(lowered.structured_outputs, results,
                                        expand_composites=True)

    def _shards(self, value, layout, copies):
        """Per-device shards of one program input in `layout` (variables: the handles
        of their shard variables; a variable of another mesh: of copies of its value
        resharded onto this mesh, appended to `copies`)."""
        variable = variable_of_handle(value)
        if variable is not None and variable.mesh == self.mesh:
            return [v.handle for v in variable.shard_variables]
        if variable is not None:
            handles = [None] * self.mesh.size
            for devices, piece in variable.sharded().pieces_on(self.mesh, layout):
                for device in devices:
                    with tf.device(self.mesh.devices[device]):
                        copies.append(tf.Variable(piece, trainable=False))
                    handles[device] = copies[-1].handle
            return handles
        if isinstance(value, ShardedTensor):
            if value.layout == layout:
                return value.shards
            value = value.numpy()
        elif hasattr(value, "numpy"):
            value = value.numpy()
        return split_value(np.asarray(value), self.mesh, layout)


def _captured_variable(graph, ref, handle):
    """The gt.Variable behind a captured resource; plain tf.Variables are refused."""
    variable = variable_of_handle(handle)
    if variable is None:
        raise ShardingError(
            f"the function captures a tf.Variable ({graph.tensor_name(ref)!r}) that is not a "
            "gt.Variable; create it with gt.Variable(value, mesh=..., spec=...) so that "
            "each device holds its shard")
    return variable


# ops that only read the variable behind their resource input
_READ_ONLY = frozenset({"ReadVariableOp", "VariableShape", "ResourceGather",
                        "ResourceGatherNd"})


def _first_writer(graph, ref):
    """The first node that may update the variable of resource `ref` (anything but a
    known read, through Identity), or None."""
    users = graph.consumers()
    pending = [ref.node]
    while pending:
        for user, _ in users[pending.pop()]:
            node = graph.nodes[user]
            if node.op == "Identity":
                pending.append(user)
            elif node.op not in _READ_ONLY:
                return node
    return None


def _mesh_text(mesh):
    """A mesh's shape and devices, for errors about two meshes with the same axes."""
    names = [d.rsplit("device:", 1)[-1] for d in mesh.devices]
    return f"{mesh!r} (devices {', '.join(names)})"


def _add_seed(graph, seeds, ref, layout, what):
    """Record a user sharding; two different ones on one tensor cannot both hold."""
    old = seeds.get(ref)
    if old is not None and old != layout:
        raise ShardingError(
            f"tensor {graph.tensor_name(ref)!r} has two shardings that cannot both hold: "
            f"{old.to_spec()!r} and {layout.to_spec()!r} ({what}); remove one of them or "
            "annotate a copy (tf.identity) instead")
    seeds[ref] = layout
