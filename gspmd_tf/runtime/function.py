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


def _local_backend(collective_timeout):
    """A backend factory: LocalBackend(mesh, collective_timeout)."""
    from gspmd_tf.backends.local import LocalBackend, check_timeout
    if collective_timeout is not None:
        check_timeout(collective_timeout)
    return functools.partial(LocalBackend, collective_timeout=collective_timeout)


def function(fn=None, *, mesh, in_shardings=None, out_shardings=None, backend=None,
             collective_timeout=None):
    """Partition `fn` over `mesh`; usable as `@gt.function(mesh=...)` or `gt.function(f, ...)`.

    in_shardings: one entry per positional argument (a PartitionSpec, a gt.Sharding, or
    None to infer); out_shardings: one per flat output, likewise. Calls return
    ShardedTensors in the structure `fn` returns. collective_timeout: seconds a call may
    take before it is cancelled with DeadlineExceededError (default: the
    GSPMD_TF_COLLECTIVE_TIMEOUT environment variable, else 300; 0 for no limit); for
    the default backend only (`backend`: a factory mesh -> gspmd_tf.backends.Backend).
    """
    if fn is None:
        return functools.partial(function, mesh=mesh, in_shardings=in_shardings,
                                 out_shardings=out_shardings, backend=backend,
                                 collective_timeout=collective_timeout)
    if backend is not None and collective_timeout is not None:
        raise ValueError("collective_timeout applies to the default backend: give it to "
                         "your backend instead")
    return Function(fn, mesh, in_shardings, out_shardings,
                    backend or _local_backend(collective_timeout))


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
        self.name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
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
                f"{self.name} got {len(args)} arguments but in_shardings has "
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
                seeds[ref] = _captured_variable(graph, ref, value).layout
        self._seed_annotations(graph, seeds)
        out_layouts = self._seed_outputs(graph, seeds)
        propagation = propagate(graph, mesh, seeds)
        out_layouts = [l or propagation.layout(r) for l, r in zip(out_layouts, graph.outputs)]
        program = partition(graph, mesh, propagation, out_layouts)
        lowered = Lowered(mesh, graph, propagation, program, len(flat), set(seeds),
                          self._backend_factory, name=f"gt.function {self.name!r}")
        lowered.structured_outputs = concrete.structured_outputs
        return lowered

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
                f"{self.name} has {len(graph.outputs)} outputs but out_shardings has "
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
        inputs = [self._shards(value, layout) for value, layout in
                  zip(list(flat) + list(graph.captures), program.input_layouts)]
        outs = run(inputs)
        results = [ShardedTensor(self.mesh, layout, lowered.graph.shape(ref),
                                 lowered.graph.dtype(ref), shards)
                   for ref, layout, shards in zip(lowered.graph.outputs,
                                                  program.output_layouts, outs)]
        return tf.nest.pack_sequence_as(lowered.structured_outputs, results,
                                        expand_composites=True)

    def _shards(self, value, layout):
        """Per-device shards of one program input in `layout` (variables: the handles
        of their shard variables)."""
        variable = variable_of_handle(value)
        if variable is not None:
            return [v.handle for v in variable.shard_variables]
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


def _add_seed(graph, seeds, ref, layout, what):
    """Record a user sharding; two different ones on one tensor cannot both hold."""
    old = seeds.get(ref)
    if old is not None and old != layout:
        raise ShardingError(
            f"tensor {graph.tensor_name(ref)!r} has two shardings that cannot both hold: "
            f"{old.to_spec()!r} and {layout.to_spec()!r} ({what}); remove one of them or "
            "annotate a copy (tf.identity) instead")
    seeds[ref] = layout
