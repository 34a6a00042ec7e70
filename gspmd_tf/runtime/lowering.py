"""gt.lower: import, propagate and partition a traced program (the stages after tracing).

gt.function traces its Python function once per input signature and hands the trace to
`lower_traced`; `lower` is the same path for a program the caller has already traced (a
ConcreteFunction or an imported Graph) or for a Python function and example arguments.
"""

from __future__ import annotations

import logging
import sys
import time

import tensorflow as tf

from gspmd_tf.errors import ShardingError
from gspmd_tf.gc_pause import gc_paused
from gspmd_tf.graph.importer import import_graph
from gspmd_tf.graph.ir import Graph, Ref
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import Mesh, PartitionSpec
from gspmd_tf.propagation.propagate import propagate
from gspmd_tf.registry import READS_VARIABLE, has_trait
from gspmd_tf.runtime.lowered import Lowered
from gspmd_tf.runtime.variables import variable_of_handle
from gspmd_tf.spmd.partitioner import partition
from gspmd_tf.spmd.regions import reads_only
from gspmd_tf.spmd.windowed_einsum import threshold_of

log = logging.getLogger("gspmd_tf")


def lower(fn, mesh, in_shardings=None, out_shardings=None, *, args=None, backend=None,
          collective_timeout=None, windowed_einsum=False):
    """Lower `fn` over `mesh` without running it: a gt.Lowered (shardings, collectives,
    report(), compile()).

    `fn` is one of
      - a tf ConcreteFunction (`tf.function(f).get_concrete_function(*specs)`): its flat
        tensor arguments are the program's inputs;
      - a Graph of gspmd_tf.graph (already imported): its `inputs` before its captures;
      - a Python function or tf.function, traced on `args` (values or tf.TensorSpec, in
        the order of its parameters), exactly as `gt.function(fn, ...).lower(*args)`.
    in_shardings: one entry per input (a PartitionSpec, a gt.Sharding, or None to infer);
    out_shardings: one per flat output, likewise. `backend` / `collective_timeout` as in
    gt.function (used by compile()), and `windowed_einsum`. The returned object's `stage_seconds` gives the wall
    time of import, propagate and partition.
    """
    from gspmd_tf.runtime.function import Function, backend_factory
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"gt.lower needs a gt.Mesh, got {mesh!r}: build one with "
                            "gt.Mesh.create(shape, axis_names) or gt.Mesh.abstract(...)")
    backend = backend_factory(backend, collective_timeout)
    traced = isinstance(fn, (Graph, tf.types.experimental.ConcreteFunction))
    if not traced:
        if args is None:
            raise ShardingError(f"gt.lower({fn!r}): give args=(...) (values or "
                                "tf.TensorSpec) to trace the function on, or pass a "
                                "ConcreteFunction")
        return Function(fn, mesh, in_shardings, out_shardings, backend,
                        windowed_einsum).lower(*args)
    if args is not None:
        raise ShardingError("gt.lower: args are for a Python function; a ConcreteFunction "
                            "or Graph is already traced")
    check_entries("in_shardings", in_shardings, "argument")
    name = getattr(fn, "name", None) or "program"
    name = name.decode() if isinstance(name, bytes) else name
    return lower_traced(fn, mesh, in_shardings, None, out_shardings, backend, name,
                        caller="gt.lower", windowed_einsum=threshold_of(windowed_einsum))


def lower_traced(traced, mesh, entries, committed, out_shardings, backend_factory, name,
                 caller="gt.function", windowed_einsum=None):
    """Import (unless `traced` is already a Graph), propagate and partition: a Lowered.

    entries: the in_shardings entry of each flat (non-captured) input (None: all None);
    committed: the layout such an input already has (a ShardedTensor's), used where its
    entry is None (None: no input has one). Captured gt.Variables enter in their own
    layouts. `name` (the function's) is used in errors; the program is called
    "`caller` 'name'". `windowed_einsum`: the byte threshold of windowed dots, or None.
    """
    # Lowering allocates several objects per op; with TF's hundreds of thousands of live
    # objects every garbage collection this triggers walks them all, which doubled the
    # time of a large program. Its garbage is freed by reference counting; any cycles
    # wait for the next collection.
    with gc_paused():
        return _lower_traced(traced, mesh, entries, committed, out_shardings,
                             backend_factory, name, caller, windowed_einsum)


def _lower_traced(traced, mesh, entries, committed, out_shardings, backend_factory, name,
                  caller, windowed_einsum):
    """lower_traced with the garbage collector paused."""
    start = time.perf_counter()
    graph = traced if isinstance(traced, Graph) else import_graph(traced)
    imported = time.perf_counter()
    log.info("gspmd_tf: %s traced: %d ops (%.1f s)", name, len(graph.nodes), imported - start)
    count = len(graph.inputs) - len(graph.captures)
    entries = [None] * count if entries is None else entries
    committed = [None] * count if committed is None else committed
    if len(entries) != count:
        raise ShardingError(f"{caller} {name!r}: the program has {count} inputs but "
                            f"in_shardings has {len(entries)} entries: give one per flat "
                            "input (None to infer)")
    seeds = {}
    spec_layouts = _SpecLayouts(mesh)
    for i, ref in enumerate(graph.inputs[:count]):
        layout = spec_layouts(entries[i], len(graph.shape(ref)),
                         lambda: f"argument {i} ({graph.tensor_name(ref)})") or committed[i]
        if layout is not None:
            seeds[ref] = layout
    for ref, value in zip(graph.inputs[count:], graph.captures):
        if graph.dtype(ref) == tf.resource:
            variable = _captured_variable(graph, ref, value)
            seeds[ref] = _variable_layout(mesh, graph, ref, variable, name)
    seed_annotations(mesh, graph, seeds)
    out_layouts = _seed_outputs(spec_layouts, graph, seeds, out_shardings, name)
    lowered = lower_seeded(graph, mesh, seeds, out_layouts, count, backend_factory,
                           f"{caller} {name!r}", windowed_einsum)
    lowered.committed_args = frozenset(
        i for i in range(count) if entries[i] is None and committed[i] is not None)
    lowered.stage_seconds["import"] = imported - start
    if not isinstance(traced, Graph):
        lowered.structured_outputs = traced.structured_outputs
    return lowered


def lower_seeded(graph, mesh, seeds, out_layouts, count, backend_factory, name,
                 windowed_einsum=None):
    """Propagate from `seeds` ({Ref: Layout}) and partition imported `graph`: a Lowered
    named `name` whose first `count` inputs are arguments; `out_layouts` holds a Layout
    or None (propagation decides) per output; `windowed_einsum` as in lower_traced."""
    start = time.perf_counter()
    propagation = propagate(graph, mesh, seeds)
    propagated = time.perf_counter()
    log.info("gspmd_tf: %s propagated from %d annotations (%.1f s)", name, len(seeds),
             propagated - start)
    out_layouts = [l or propagation.layout(r) for l, r in zip(out_layouts, graph.outputs)]
    # the backend says which all-reduces are worth combining (an abstract mesh runs none)
    combine_bytes = (None if mesh.is_abstract
                     else backend_factory(mesh).all_reduce_combine_bytes)
    program = partition(graph, mesh, propagation, out_layouts, windowed_einsum, combine_bytes)
    log.info("gspmd_tf: %s partitioned: %d ops in the SPMD program (%.1f s)", name,
             len(program.graph.nodes), time.perf_counter() - propagated)
    lowered = Lowered(mesh, graph, propagation, program, count, set(seeds), backend_factory,
                      name=name)
    lowered.stage_seconds.update({"propagate": propagated - start,
                                  "partition": time.perf_counter() - propagated})
    return lowered


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


class _SpecLayouts:
    """_spec_layout memoised by (entry, rank): a stack of layers repeats a few specs
    thousands of times. `what()` names the tensor, for errors."""

    def __init__(self, mesh):
        self.mesh = mesh
        self._memo = {}

    def __call__(self, entry, rank, what):
        try:
            key = (entry, rank)
            return self._memo[key]
        except KeyError:
            layout = self._memo[key] = _spec_layout(self.mesh, entry, rank, what())
            return layout
        except TypeError:  # an unhashable entry (a list)
            return _spec_layout(self.mesh, entry, rank, what())


def check_entries(kind, entries, per):
    """in/out_shardings must be a sequence with one entry per argument / flat output."""
    if entries is not None and (isinstance(entries, PartitionSpec)
                                or not isinstance(entries, (tuple, list))):
        raise ShardingError(
            f"{kind}={entries!r}: give a tuple with one entry per {per}, e.g. "
            f"{kind}=(P('data'),) for one")


def _variable_layout(mesh, graph, ref, variable, name):
    """The layout captured gt.Variable `variable` enters the program with: its own on
    its own mesh. From another mesh it is read-only (updates would have to reach
    shards this program does not hold): its value enters resharded to its spec on
    this mesh, or replicated where this mesh lacks the spec's axes."""
    if variable.mesh == mesh:
        return variable.layout
    writer = _first_writer(graph, ref)
    if writer is not None:
        raise ShardingError(
            f"{name} updates variable {variable.name!r} ({writer.op} "
            f"{writer.name!r}) but runs on {_mesh_text(mesh)} while the variable "
            f"lives on {_mesh_text(variable.mesh)}: run the function on the "
            "variable's mesh, or make the variable on this mesh (e.g. gt.Variable("
            "v.numpy(), mesh, spec)); reading a variable of another mesh works")
    try:
        return Layout.from_spec(mesh, variable.spec, len(variable.shape))
    except ShardingError:
        return Layout.replicated(len(variable.shape))


def seed_annotations(mesh, graph, seeds):
    from gspmd_tf.sharding import Sharding
    for ref, proto in graph.annotations.items():
        tensor = graph.tensor_name(ref)
        layout = Sharding.from_proto(proto).to_layout(
            mesh, len(graph.shape(ref)), f"tensor {tensor!r}")
        _add_seed(graph, seeds, ref, layout, f"annotation on {tensor!r}")


def _seed_outputs(spec_layouts, graph, seeds, out_shardings, name):
    if out_shardings is None:
        return [None] * len(graph.outputs)
    check_entries("out_shardings", out_shardings, "flat output")
    if len(out_shardings) != len(graph.outputs):
        raise ShardingError(
            f"{name} has {len(graph.outputs)} outputs but out_shardings has "
            f"{len(out_shardings)} entries: give one per flat output")
    layouts = []
    for i, (ref, entry) in enumerate(zip(graph.outputs, out_shardings)):
        layout = spec_layouts(entry, len(graph.shape(ref)), lambda: f"output {i}")
        if layout is not None:
            _add_seed(graph, seeds, ref, layout, f"out_shardings[{i}]")
        layouts.append(layout)
    return layouts


# Keras keeps a layer's weights in plain tf.Variables, which _captured_variable refuses
_KERAS_HINT = (". A Keras layer or model called inside gt.function brings its own "
               "tf.Variables: call gt.keras.shard_model(model, mesh, layout_map) on it "
               "first (it backs the variables by gt.Variables; then model.fit/predict, or "
               "calling the model inside gt.function, run partitioned)")


def _captured_variable(graph, ref, handle):
    """The gt.Variable behind a captured resource; plain tf.Variables are refused."""
    variable = variable_of_handle(handle)
    if variable is None:
        raise ShardingError(
            f"the function captures a tf.Variable ({graph.tensor_name(ref)!r}) that is not a "
            "gt.Variable; create it with gt.Variable(value, mesh=..., spec=...) so that "
            "each device holds its shard" + _KERAS_HINT * ("keras" in sys.modules))
    return variable


def _first_writer(graph, ref):
    """The first node that may update the variable of resource `ref` (anything but a
    known read, through Identity and control-flow ops whose bodies only read it), or
    None."""
    users = graph.consumers()
    pending = [ref]
    while pending:
        ref = pending.pop()
        for user, pos in users[ref.node]:
            node = graph.nodes[user]
            if node.inputs[pos] != ref:
                continue
            if node.op == "Identity":
                pending.append(Ref(user, 0))
            elif node.regions and reads_only(node, pos):
                if "While" in node.op:  # the loop hands the handle on as its output pos
                    pending.append(Ref(user, pos))
            elif not has_trait(node.op, READS_VARIABLE):
                return node
    return None


def _mesh_text(mesh):
    """A mesh's shape and devices (row-major positions), for errors about two meshes
    with the same axes."""
    if mesh.devices is None:
        return f"{mesh!r} (abstract: no devices)"
    names = [mesh.devices[i].rsplit("device:", 1)[-1] for i in mesh.device_ids.ravel()]
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
