"""The lowering stages after tracing: import, propagate and partition a traced program
into a Lowered.

gt.function and gt.lower (runtime/function.py) trace the Python function
(runtime/trace.py) and hand the trace to `lower_traced`; a program already imported
(`python -m gspmd_tf inspect`) seeds its own layouts and calls `lower_seeded`. What is
fixed per function (mesh, backend, out_shardings, windowed einsum, names) is one
LowerOptions record.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from gspmd_tf.autoshard import is_auto
from gspmd_tf.autoshard.search import choose
from gspmd_tf.errors import ShardingError
from gspmd_tf.gc_pause import gc_paused
from gspmd_tf.graph.importer import import_graph
from gspmd_tf.graph.ir import Graph
from gspmd_tf.graph.variable_reads import first_writer
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import Mesh, PartitionSpec
from gspmd_tf.propagation.knobs import traced_knobs
from gspmd_tf.propagation.propagate import propagate
from gspmd_tf.runtime.lowered import Lowered
from gspmd_tf.runtime.options import LowerOptions, check_entries
from gspmd_tf.runtime.strict import check_strict
from gspmd_tf.runtime.variables import variable_of_handle
from gspmd_tf.sharding import Placement, Sharding
from gspmd_tf.spmd.partitioner import partition

log = logging.getLogger("gspmd_tf")


def lower_traced(traced, options: LowerOptions, entries: Optional[Sequence] = None,
                 committed: Optional[Sequence[Optional[Layout]]] = None) -> Lowered:
    """Import `traced` (a ConcreteFunction, or a Graph already imported), propagate and
    partition it: a Lowered.

    entries: the in_shardings entry of each flat (non-captured) input (None: all None);
    committed: the layout such an input already has (a ShardedTensor's), used where its
    entry is None (None: no input has one). Captured gt.Variables enter in their own
    layouts.
    """
    # Lowering allocates several objects per op; with TF's hundreds of thousands of live
    # objects every garbage collection this triggers walks them all, which doubled the
    # time of a large program. Its garbage is freed by reference counting; any cycles
    # wait for the next collection.
    with gc_paused():
        return _lower_traced(traced, options, entries, committed)


def _lower_traced(traced, options, entries, committed):
    """lower_traced with the garbage collector paused."""
    mesh, name = options.mesh, options.name
    start = time.perf_counter()
    graph = traced if isinstance(traced, Graph) else import_graph(traced)
    imported = time.perf_counter()
    log.info("gspmd_tf: %s traced: %d ops (%.1f s)", name, len(graph.nodes), imported - start)
    count = len(graph.inputs) - len(graph.captures)
    entries = [None] * count if entries is None else entries
    committed = [None] * count if committed is None else committed
    if len(entries) != count:
        raise ShardingError(f"{options.program_name}: the program has {count} inputs but "
                            f"in_shardings has {len(entries)} entries: give one per flat "
                            "input (None to infer)")
    seeds, placed_inputs = {}, {}
    spec_layouts = _SpecLayouts(mesh)
    auto_args = [i for i in range(count) if is_auto(entries[i])]
    for i, ref in enumerate(graph.inputs[:count]):
        if is_auto(entries[i]):
            continue
        entry = entries[i]
        if entry is None and isinstance(committed[i], Sharding):
            entry = committed[i]  # a ShardedTensor of another mesh of the same devices
        placement = spec_layouts(entry, len(graph.shape(ref)),
                                 lambda: f"argument {i} ({graph.tensor_name(ref)})")
        if placement is not None:
            seeds[ref] = placement.layout
            if placement.mesh is not mesh:
                placed_inputs[i] = placement.mesh
        elif committed[i] is not None:
            seeds[ref] = committed[i]
    for ref, value in zip(graph.inputs[count:], graph.captures):
        if graph.dtype(ref) == tf.resource:
            variable = _captured_variable(graph, ref, value)
            seeds[ref] = _variable_layout(mesh, graph, ref, variable, name)
    seed_annotations(mesh, graph, seeds)
    out_layouts, placed_outputs = _seed_outputs(spec_layouts, graph, seeds,
                                                options.out_shardings, name)
    placements = placed_inputs, placed_outputs
    auto_outputs = [j for j, entry in enumerate(options.out_shardings or ())
                    if is_auto(entry)]

    source_graph = None if isinstance(traced, Graph) else traced.graph
    knobs = traced_knobs(source_graph, graph)

    def lowered(propagation, program, seconds, seeds, plan=None):
        result = Lowered(
            options, graph, propagation, program, num_args=count,
            annotated=frozenset(seeds),
            committed_args=frozenset(i for i in range(count)
                                     if entries[i] is None and committed[i] is not None),
            structured_outputs=None if isinstance(traced, Graph)
            else traced.structured_outputs,
            stage_seconds={"import": imported - start, **seconds}, auto_plan=plan,
            source_graph=source_graph)
        if options.strict:
            check_strict(result)
        return result

    if auto_args or auto_outputs:
        return _lower_auto(graph, seeds, out_layouts, auto_args, auto_outputs, options,
                           lowered, knobs, placements)
    return lowered(*_propagate_and_partition(graph, seeds, out_layouts, options, knobs,
                                             placements), seeds)


# How many times the search may tighten its budget when the lowered program's peak
# (which counts the partitioner's temporaries: reshards, partial results) exceeds
# memory_limit although the search's estimate fit.
AUTO_ATTEMPTS = 3


def _lower_auto(graph, seeds, out_layouts, auto_args, auto_outputs, options, lowered,
                knobs, placements):
    """Lower with the AUTO entries chosen by the search (gspmd_tf/autoshard) within
    options.memory_limit as lowered.memory() counts it: when the lowered peak exceeds
    the limit, search again with the budget lowered by the estimate's shortfall."""
    limit = budget = options.memory_limit
    for _ in range(AUTO_ATTEMPTS):
        try:
            plan = _auto_plan(graph, seeds, auto_args, auto_outputs, options, budget)
        except ShardingError:
            if budget == limit:  # nothing fits the user's limit: the search says why
                raise
            break  # nothing fits the tightened budget: the lowered peak was over
        chosen, layouts = {**seeds, **plan.layouts}, list(out_layouts)
        for j, layout in plan.output_layouts.items():
            layouts[j] = layout
        propagation, program, seconds = _propagate_and_partition(graph, chosen, layouts,
                                                                 options, knobs, placements)
        decided = [graph.inputs[i] for i in plan.input_layouts] + [
            graph.outputs[j] for j in plan.output_layouts]
        result = lowered(propagation, program, {"auto": plan.search_seconds, **seconds},
                         {**seeds, **dict.fromkeys(decided)}, plan)
        if limit is None:
            return result
        peak = result.memory().peak
        if peak <= limit:
            return result
        budget = min(budget - (peak - limit), limit - (peak - plan.peak_bytes))
        if budget <= 0:
            break
    raise ShardingError(
        f"{options.program_name}: the auto-sharding plan of its AUTO entries needs "
        f"{peak} bytes per device once partitioned (lowered.memory().peak), over "
        f"memory_limit={limit}, and tightening the search's budget did not bring it "
        "under: raise memory_limit, run on a mesh with more devices, or give more of "
        "the large tensors AUTO or split in_shardings")


def _auto_plan(graph, seeds, auto_args, auto_outputs, options, budget):
    """The auto-sharding stage (gspmd_tf/autoshard): propagate from the given shardings
    (for every node's rule), then choose the AUTO entries' layouts within `budget`
    bytes per device."""
    propagation = propagate(graph, options.mesh, seeds)
    resident = 0  # captured variables' shards: held throughout, whatever is chosen
    for ref, value in zip(graph.inputs[len(graph.inputs) - len(graph.captures):],
                          graph.captures):
        variable = variable_of_handle(value) if graph.dtype(ref) == tf.resource else None
        if variable is not None and ref in seeds:
            resident += variable.dtype.size * int(np.prod(
                seeds[ref].local_shape(options.mesh, variable.shape), dtype=np.int64))
    return choose(graph, options.mesh, propagation.rules[:len(graph.nodes)], seeds,
                  auto_args, auto_outputs, budget, resident,
                  options.program_name)


def lower_seeded(graph: Graph, seeds: dict, num_args: int, options: LowerOptions,
                 named_inputs: tuple = ()) -> Lowered:
    """Propagate from `seeds` ({Ref: Layout}) and partition imported `graph`, its outputs
    where propagation puts them: a Lowered whose first `num_args` inputs are arguments
    (`named_inputs` as Lowered has them)."""
    propagation, program, seconds = _propagate_and_partition(
        graph, seeds, [None] * len(graph.outputs), options)
    return Lowered(options, graph, propagation, program, num_args=num_args,
                   annotated=frozenset(seeds), stage_seconds=seconds,
                   named_inputs=named_inputs)


def _propagate_and_partition(graph, seeds, out_layouts, options, knobs=None,
                             placements=({}, {})):
    """The propagate and partition stages: (Propagation, SpmdProgram, their seconds).
    `out_layouts` holds a Layout or None (propagation decides) per output; `knobs` the
    user priorities, sharding groups and barriers (knobs.traced_knobs); `placements`
    ({input index: mesh}, {output index: mesh}) the boundaries a sharding places in
    another order of the mesh's devices (Sharding.placement)."""
    mesh, name = options.mesh, options.program_name
    start = time.perf_counter()
    propagation = propagate(graph, mesh, seeds, knobs=knobs)
    propagated = time.perf_counter()
    log.info("gspmd_tf: %s propagated from %d annotations (%.1f s)", name, len(seeds),
             propagated - start)
    out_layouts = [l or propagation.layout(r) for l, r in zip(out_layouts, graph.outputs)]
    # the backend says which all-reduces are worth combining and prices every choice
    # with its cost model (an abstract mesh runs none: CostModel.for_mesh)
    backend = None if mesh.is_abstract else options.backend_factory(mesh)
    program = partition(graph, mesh, propagation, out_layouts, options.windowed_einsum,
                        backend and backend.all_reduce_combine_bytes,
                        backend and backend.cost_model, annotated=frozenset(seeds),
                        input_placements=placements[0], output_placements=placements[1])
    partitioned = time.perf_counter()
    log.info("gspmd_tf: %s partitioned: %d ops in the SPMD program (%.1f s)", name,
             len(program.graph.nodes), partitioned - propagated)
    return propagation, program, {"propagate": propagated - start,
                                  "partition": partitioned - propagated}


def _spec_placement(mesh, entry, rank, what):
    """An in/out sharding entry as a Placement (None stays None): its Layout, and the
    mesh it places the tiles as on (`mesh`, or for a gt.Sharding whose device order no
    layout of `mesh` gives, those devices in its order)."""
    if entry is None:
        return None
    if isinstance(entry, Sharding):
        return entry.placement(mesh, rank, what)
    if isinstance(entry, (PartitionSpec, tuple, list)):
        return Placement(Layout.from_spec(mesh, PartitionSpec(*entry), rank, what), mesh)
    raise ShardingError(f"{what}: expected a PartitionSpec, gt.Sharding or None, got {entry!r}")


class _SpecLayouts:
    """_spec_placement memoised by (entry, rank): a stack of layers repeats a few specs
    thousands of times. `what()` names the tensor, for errors."""

    def __init__(self, mesh):
        self.mesh = mesh
        self._memo = {}

    def __call__(self, entry, rank, what):
        try:
            key = (entry, rank)
            return self._memo[key]
        except KeyError:
            placement = self._memo[key] = _spec_placement(self.mesh, entry, rank, what())
            return placement
        except TypeError:  # an unhashable entry (a list)
            return _spec_placement(self.mesh, entry, rank, what())


def _variable_layout(mesh, graph, ref, variable, name):
    """The layout captured gt.Variable `variable` enters the program with: its own on
    its own mesh. From another mesh it is read-only (updates would have to reach
    shards this program does not hold): its value enters resharded to its spec on
    this mesh, or replicated where this mesh lacks the spec's axes."""
    if variable.mesh == mesh:
        return variable.layout
    writer = first_writer(graph, ref)
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


def seed_annotations(mesh: Mesh, graph: Graph, seeds: dict) -> None:
    """Add the sharding annotations inside `graph` (XlaSharding ops and attrs) to `seeds`
    ({Ref: Layout}); a tensor annotated two different ways is a ShardingError. A device
    order no layout of the mesh gives is taken as the layout with its tiles
    (Sharding.placement): an intermediate's placement is not observable
    (Lowered.placement_notes says which)."""
    for ref, proto in graph.annotations.items():
        tensor = graph.tensor_name(ref)
        layout = Sharding.from_proto(proto).placement(
            mesh, len(graph.shape(ref)), f"tensor {tensor!r}").layout
        _add_seed(graph, seeds, ref, layout, f"annotation on {tensor!r}")


def _seed_outputs(spec_layouts, graph, seeds, out_shardings, name):
    """The layout out_shardings asks of each output (None: propagation decides), each
    seeded, and {output index: mesh} of those placed in another order of the devices."""
    if out_shardings is None:
        return [None] * len(graph.outputs), {}
    check_entries("out_shardings", out_shardings, "flat output")
    if len(out_shardings) != len(graph.outputs):
        raise ShardingError(
            f"{name} has {len(graph.outputs)} outputs but out_shardings has "
            f"{len(out_shardings)} entries: give one per flat output")
    layouts, placed = [], {}
    for i, (ref, entry) in enumerate(zip(graph.outputs, out_shardings)):
        if is_auto(entry):  # chosen by the auto-sharding search
            layouts.append(None)
            continue
        placement = spec_layouts(entry, len(graph.shape(ref)), lambda: f"output {i}")
        layout = None if placement is None else placement.layout
        if layout is not None:
            _add_seed(graph, seeds, ref, layout, f"out_shardings[{i}]")
            if placement.mesh is not spec_layouts.mesh:
                placed[i] = placement.mesh
        layouts.append(layout)
    return layouts, placed


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
            "each device holds its shard, or pass gt.function(..., layout_map={path regex: "
            "spec}) to take the function's tf.Variables over" + _KERAS_HINT * ("keras" in sys.modules))
    return variable


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
