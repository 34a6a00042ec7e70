"""Advice: for each collective above a size, the user sharding whose change removes it or
makes it cheaper, found by lowering again with alternatives and pricing every program
with the one cost model (gspmd_tf/cost_model.py).

The candidates are the user shardings (in_shardings entries, gt.mesh_split /
xla_sharding annotations, out_shardings entries, the specs of captured gt.Variables)
that the collective's tensors and op take an axis from (Propagation.origin), or every
one when none does. Each candidate is tried with every spec that splits its dims
evenly over the mesh axes (each axis on one dim or none), one change at a time: the
program is propagated and partitioned again and its collectives priced
(CostModel.collective_seconds). A change may not raise the per-device memory (arguments
or estimated peak): replicating a weight removes collectives by spending memory, a
trade the cost model of communication cannot weigh. A collective is addressed by a
change after which the collectives of its kind that its op needs move fewer bytes; the
advice is the change that addresses it and saves the most seconds over the program.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
import tensorflow as tf

from gspmd_tf.cost_model import CostModel
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import PartitionSpec
from gspmd_tf.propagation.knobs import traced_knobs
from gspmd_tf.propagation.propagate import propagate
from gspmd_tf.runtime.variables import variable_of_handle
from gspmd_tf.spmd.partitioner import partition

MAX_LOWERINGS = 64  # alternatives tried at most per advise() call


@dataclass(frozen=True)
class Advice:
    """Change user sharding `where` (e.g. "in_shardings[2] (argument 'w2')", or "the
    gt.mesh_split at model.py:12") of graph tensor `tensor` from `current` to `spec`
    (PartitionSpecs): it removes (`removes`) or shrinks collective `collective` (a
    gt.Collective), and saves `bytes_saved` collective bytes per device and
    `seconds_saved` (cost model) on every step of the whole program."""

    collective: object
    tensor: str
    where: str
    current: PartitionSpec
    spec: PartitionSpec
    bytes_saved: int
    seconds_saved: float
    removes: bool

    def text(self) -> str:
        """One line of advice."""
        effect = "removes" if self.removes else "shrinks"
        c = self.collective
        return (f"{self.where}: {self.current!r} -> {self.spec!r} {effect} the {c.kind} "
                f"of {c.bytes} bytes for op {c.op!r}; saves {self.bytes_saved} bytes "
                f"per device per step ({self.seconds_saved * 1e6:.1f} us on the cost "
                "model)")


def advise(lowered, threshold_bytes: int = 0) -> list:
    """Advice (see the module doc) for every collective of `lowered` (a gt.Lowered)
    moving more than `threshold_bytes` per device; collectives no single change helps
    get none. At most MAX_LOWERINGS alternatives are lowered."""
    model = CostModel.for_mesh(lowered.mesh)
    big = [c for c in lowered.collectives() if c.bytes > threshold_bytes and c.origins]
    if not big:
        return []
    seeds = {ref: lowered.propagation.layout(ref) for ref in lowered._annotated}
    # the program as the alternatives are lowered (the cost model's combiner threshold)
    base, memory = _relower(lowered, seeds)
    base_seconds, base_bytes = _seconds(model, base), sum(c.bytes for c in base)
    tried = {}  # (ref, layout) -> (collectives, seconds), None when it needs more memory
    advice = []
    for collective in big:
        best = None
        for ref in _candidates(lowered, collective, seeds):
            for layout in _alternatives(lowered, ref, seeds[ref]):
                if (ref, layout) not in tried:
                    if len(tried) >= MAX_LOWERINGS:
                        break
                    again, more = _relower(lowered, {**seeds, ref: layout})
                    tried[ref, layout] = (None if more.arguments > memory.arguments
                                          or more.peak > memory.peak
                                          else (again, _seconds(model, again)))
                if tried[ref, layout] is None:
                    continue
                again, seconds = tried[ref, layout]
                left = _moved(again, collective)
                saved = base_seconds - seconds
                if left < collective.bytes and saved > 0 and (best is None
                                                              or saved > best[0]):
                    best = (saved, ref, layout, again, left)
        if best is not None:
            saved, ref, layout, again, left = best
            advice.append(Advice(collective, lowered.graph.tensor_name(ref),
                                 _where(lowered, ref), seeds[ref].to_spec(), layout.to_spec(),
                                 base_bytes - sum(c.bytes for c in again), saved, left == 0))
    return advice


def _seconds(model, collectives):
    return sum(model.collective_seconds(c.kind, c.bytes, c.axes) for c in collectives)


def _moved(collectives, target) -> int:
    """Bytes the collectives of `target`'s kind that its op needs move (after a change)."""
    return sum(c.bytes for c in collectives if c.kind == target.kind
               and any(o.op == target.op for o in c.origins))


def _candidates(lowered, collective, seeds):
    """The seeds (Refs) the collective's tensors and op take an axis from; all of them
    when none does."""
    graph, propagation = lowered.graph, lowered.propagation
    names = set()
    for origin in collective.origins:
        try:
            node = graph.nodes[graph.node_index(origin.op)]
        except KeyError:  # an op of a control-flow body
            continue
        refs = list(node.inputs) + [graph.ref(origin.op)]
        if origin.tensor:
            refs.append(graph.ref(origin.tensor))
        names.update(o.seed for ref in refs for o in propagation.origin(ref))
    found = [ref for ref in seeds if graph.tensor_name(ref) in names]
    return found or list(seeds)


def _alternatives(lowered, ref, current):
    """Every layout of `ref` splitting its dims evenly over the mesh axes (each axis on
    one dim or none; several on a dim in mesh order), but `current`."""
    mesh, shape = lowered.mesh, lowered.graph.shape(ref)
    names = mesh.axis_names
    for placement in itertools.product(range(len(shape) + 1), repeat=len(names)):
        dims = tuple(tuple(a for a, d in zip(names, placement) if d == k)
                     for k in range(len(shape)))
        layout = Layout(dims)
        if layout != current and all(n % mesh.axes_size(axes) == 0
                                     for n, axes in zip(shape, dims)):
            yield layout


def _relower(lowered, seeds) -> tuple:
    """(collectives, Memory) of `lowered`'s graph propagated from `seeds` and
    partitioned."""
    graph, mesh, options = lowered.graph, lowered.mesh, lowered.options
    propagation = propagate(graph, mesh, seeds,
                            knobs=traced_knobs(lowered.source_graph, graph))
    program = partition(graph, mesh, propagation,
                        [propagation.layout(r) for r in graph.outputs],
                        options.windowed_einsum, annotated=frozenset(seeds),
                        input_placements=lowered.program.input_placements,
                        output_placements=lowered.program.output_placements)
    again = type(lowered)(options, graph, propagation, program,
                          num_args=lowered.num_args, annotated=frozenset(seeds), stage_seconds={},
                          source_graph=lowered.source_graph)
    return again.collectives(), again.memory()


def _where(lowered, ref) -> str:
    """Where the user gave the sharding of seed `ref`: an argument's in_shardings entry,
    an annotation's source line, or an output's out_shardings entry."""
    graph = lowered.graph
    name = graph.tensor_name(ref)
    if ref in graph.inputs[:lowered.num_args]:
        return f"in_shardings[{graph.inputs.index(ref)}] (argument {name!r})"
    if ref in graph.annotations:
        line = lowered.source_line(graph.nodes[ref.node].name)
        return f"the annotation {name!r}" + (f" at {line}" if line else "")
    if ref in graph.outputs:
        return f"out_shardings[{graph.outputs.index(ref)}] (output {name!r})"
    if graph.dtype(ref) == tf.resource and ref in graph.inputs:
        variable = variable_of_handle(
            graph.captures[graph.inputs.index(ref) - lowered.num_args])
        if variable is not None:
            return f"the spec of gt.Variable {variable.name!r}"
    return f"the sharding of {name!r}"
