"""Lowered: a partitioned function for one input signature, before or after compiling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from gspmd_tf.autoshard.pinning import ROUNDS, activation_hints, hint_lines
from gspmd_tf.backends.base import COLLECTIVE_KINDS
from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Graph
from gspmd_tf.graph.text import program_text
from gspmd_tf.layout import Layout, permute_pairs
from gspmd_tf.mesh import PartitionSpec
from gspmd_tf.propagation.knobs import traced_knobs
from gspmd_tf.propagation.propagate import Propagation
from gspmd_tf.runtime.advice import advise
from gspmd_tf.runtime.explain import explain
from gspmd_tf.runtime.html_report import render_html
from gspmd_tf.runtime.layers import layer_stats, layer_table
from gspmd_tf.runtime.memory import Memory, program_memory
from gspmd_tf.runtime.options import LowerOptions
from gspmd_tf.runtime.sources import SourceLines
from gspmd_tf.sharding import Sharding
from gspmd_tf.spmd.partitioner import SpmdProgram
from gspmd_tf.spmd.program import COLLECTIVES


@dataclass(frozen=True)
class CollectiveOrigin:
    """Why a collective exists: op `op` of the traced graph needs it, created at the
    user's `source` line ("file.py:LINE", "" when unknown); for a reshard, graph tensor
    `tensor` goes from `from_sharding` to `to_sharding` (gt.Shardings of its dims; a
    pending sum shows as reason "contraction"), also given as PartitionSpecs
    `from_spec`/`to_spec`; `reason` is a code of gspmd_tf.spmd.provenance.REASONS
    ("contraction", "operand layout", "no rule", ...); `bytes` its share of the
    collective's bytes per device (a combined all-reduce's member: its own operand's)."""

    op: str
    source: str
    tensor: str
    from_sharding: Optional[Sharding]
    to_sharding: Optional[Sharding]
    reason: str
    from_spec: Optional[PartitionSpec] = None
    to_spec: Optional[PartitionSpec] = None
    bytes: int = 0

    def text(self) -> str:
        """One line: "op 'name' (file.py:LINE): 'x' P(...) -> P(...), reason"."""
        where = f" ({self.source})" if self.source else ""
        pending = " (partial sums)" if self.reason == "contraction" else ""
        move = (f": {self.tensor!r} {self.from_spec!r}{pending} -> {self.to_spec!r}"
                if self.from_spec is not None else "")
        return f"op {self.op!r}{where}{move}, {self.reason}"


@dataclass(frozen=True)
class Collective:
    """One collective of the SPMD program, as XLA names it.

    `shape`/`dtype`/`bytes` describe one device's operand; `groups` lists the device ids
    that take part together (for collective-permute: the (source, target) pairs).
    `origins` holds a CollectiveOrigin per op that needs it (several for all-reduces the
    combiner merged); `op`, `source`, `from_sharding`, `to_sharding` and `reason` are
    the first one's (empty when the partitioner recorded none).
    """

    kind: str
    shape: tuple
    dtype: object
    bytes: int
    groups: tuple
    axes: tuple
    origins: tuple = ()

    @property
    def op(self) -> str:
        """The graph op that needs this collective (the first, for a combined one)."""
        return self.origins[0].op if self.origins else ""

    @property
    def source(self) -> str:
        """The user's "file.py:LINE" that created that op ("" when unknown)."""
        return self.origins[0].source if self.origins else ""

    @property
    def from_sharding(self) -> Optional[Sharding]:
        """The sharding the moved tensor had (None for an op's own exchange)."""
        return self.origins[0].from_sharding if self.origins else None

    @property
    def to_sharding(self) -> Optional[Sharding]:
        """The sharding the moved tensor gets (None for an op's own exchange)."""
        return self.origins[0].to_sharding if self.origins else None

    @property
    def reason(self) -> str:
        """Why: a gspmd_tf.spmd.provenance.REASONS code ("" when unknown)."""
        return self.origins[0].reason if self.origins else ""


class Lowered:
    """The result of gt.lower(...) or gt.function(...).lower(...): shardings, collectives,
    report, compile. Built complete by the lowering stages (runtime/lowering.py).

    `options` are the LowerOptions it was lowered with; `name` the program's name
    (`gt.function 'f'`); `graph` the imported graph, `propagation` its shardings,
    `program` the SPMD program. `stage_seconds` holds the wall time of the stages after
    tracing ("import", "propagate", "partition"); `structured_outputs` the traced
    function's output structure (None for a program given as an imported Graph);
    `committed_args` the flat arguments whose layout is the ShardedTensor passed
    (in_shardings left open); `named_inputs` (name, graph tensor name) of the inputs of
    a program lowered from a SavedModel signature (`python -m gspmd_tf inspect`);
    `auto_plan` the auto-sharding search's gspmd_tf.autoshard.plan.AutoPlan (None when
    no entry is gt.AUTO); `source_graph` the traced tf.Graph, whose ops' tracebacks give
    the user's source lines (None: unknown).
    """

    def __init__(self, options: LowerOptions, graph: Graph, propagation: Propagation,
                 program: SpmdProgram, *, num_args: int, annotated: frozenset,
                 stage_seconds: dict, committed_args: frozenset = frozenset(),
                 structured_outputs=None, named_inputs: tuple = (), auto_plan=None,
                 source_graph=None):
        self.options = options
        self.mesh = options.mesh
        self.name = options.program_name
        self.graph = graph
        self.propagation = propagation
        self.program = program
        self.stage_seconds = stage_seconds
        self.committed_args = committed_args
        self.structured_outputs = structured_outputs
        self.named_inputs = named_inputs
        self.auto_plan = auto_plan
        self.num_args = num_args  # the flat arguments (the inputs before the captures)
        self.source_graph = source_graph
        self._annotated = annotated
        self._run = None  # the compiled program, built on first use
        self._consumers = None  # graph.consumers(), made on first use by explain()
        self.source_line = SourceLines(source_graph)  # graph op name -> "file.py:LINE"

    def _sharding(self, layout):
        return Sharding.from_layout(self.mesh, layout)

    @property
    def input_shardings(self):
        """gt.Sharding of every flat argument, in order (as placed on the devices: an
        in_shardings entry's own device order, see Sharding.placement)."""
        placed = self.program.input_placements
        return [Sharding.from_layout(placed.get(i, self.mesh), l)
                for i, l in enumerate(self.program.input_layouts[:self.num_args])]

    @property
    def output_shardings(self):
        """gt.Sharding of every flat output, in order (as placed, like input_shardings)."""
        placed = self.program.output_placements
        return [Sharding.from_layout(placed.get(j, self.mesh), l)
                for j, l in enumerate(self.program.output_layouts)]

    def sharding_of(self, name):
        """gt.Sharding chosen for tensor `name` ("op" or "op:k") of the traced graph."""
        try:
            ref = self.graph.ref(name)
        except (KeyError, ValueError):
            raise ShardingError(f"no tensor named {name!r} in the traced graph") from None
        return self._sharding(self.propagation.layout(ref))

    def explain(self, name):
        """Why tensor `name` ("op" or "op:k", as sharding_of takes) has its sharding, in
        words: for each mesh axis splitting it, the user sharding it came from (argument
        and its in_shardings entry, captured gt.Variable, gt.mesh_split annotation or
        out_shardings entry) and each op it went through, forward or backward, with the
        propagation layer; for each dim that lacks an axis a neighbouring tensor holds,
        why (the axis splits another dim: which annotation won and by which priority; or
        the op's rule keeps the dim whole). Returns the text (print it)."""
        text = explain(self, name)
        tensor = self.graph.tensor_name(self.graph.ref(name))
        text += "".join(f"\n{note}" for note in self.placement_notes(tensor))
        if self.auto_plan is not None and self.graph.ref(name) in self.auto_plan.layouts:
            text += ("\nThe auto-sharding search chose this layout for the gt.AUTO entries' "
                     "plan (auto_report() lists the decisions and their costs).")
        return text

    def placement_notes(self, tensor: str | None = None) -> list:
        """One line per annotation inside the program whose device order no layout of
        the mesh gives: the layout with its tiles per dim it was taken as
        (Sharding.placement) and how many devices hold another tile than it names.
        Values do not change: where an intermediate's tiles sit is not observable.
        With `tensor` (a name as the lines print it), only that tensor's line."""
        notes = []
        for graph in _graphs(self.graph):
            for ref, proto in graph.annotations.items():
                if tensor is not None and graph.tensor_name(ref) != tensor:
                    continue
                sharding = Sharding.from_proto(proto)
                if not sharding.is_tiled:
                    continue
                layout, placed = sharding.placement(self.mesh, len(graph.shape(ref)))
                if placed is self.mesh:
                    continue
                moved = sum(s != t for s, t in permute_pairs(self.mesh, layout, layout,
                                                               placed, self.mesh))
                notes.append(
                    f"{graph.tensor_name(ref)}: annotation {sharding} taken as "
                    f"{layout.to_spec()!r}, its tiles on the mesh's axes; {moved} of "
                    f"{self.mesh.size} devices hold another tile than it names (an "
                    "intermediate's placement is not observable; its values are the same)")
        return notes

    def layout_of(self, name):
        """The Layout (mesh-axis form) chosen for tensor `name`."""
        return self.propagation.layout(self.graph.ref(name))

    def collectives(self):
        """Every collective of the SPMD program, in program order; a control-flow op's
        are followed by those of its bodies (listed once, though a loop body's run on
        every iteration)."""
        out = []
        for g, node in _with_graphs(self.program.graph):
            if node.op not in COLLECTIVES:
                continue
            operand = node.inputs[0]
            shape = g.shape(operand)
            dtype = g.dtype(operand)
            if node.op == "gt.Permute":
                groups = tuple(node.params["pairs"])
            else:
                groups = tuple(tuple(int(d) for d in row)
                               for row in self.mesh.groups(node.params["axes"]))
            size = int(np.prod(shape, dtype=np.int64)) * dtype.size
            origins = self.program.origins.get(node.name, ())
            # bytes per origin: a combined all-reduce's members their own operands'; one
            # op's collective (later ops sharing it: 0) all of it
            whole = sum(not o.shared for o in origins) == 1
            out.append(Collective(COLLECTIVE_KINDS[node.op], tuple(shape), dtype, size, groups,
                                  tuple(node.params.get("axes", ())),
                                  tuple(self._origin(o, 0 if o.shared else
                                                     size if whole else o.bytes)
                                        for o in origins)))
        return out

    def _origin(self, origin, size) -> CollectiveOrigin:
        """A provenance.Origin as the CollectiveOrigin users see (`size`: its bytes)."""
        def sharding(layout):
            return None if layout is None else self._sharding(Layout(layout.dims))

        def spec(layout):
            return None if layout is None else layout.to_spec()
        return CollectiveOrigin(origin.op, self.source_line(origin.op), origin.tensor,
                                sharding(origin.source), sharding(origin.target),
                                origin.reason, spec(origin.source), spec(origin.target), size)

    def layers(self) -> list:
        """Per-layer accounting (runtime/layers.py): a LayerStats per name scope (a Keras
        layer's path; gradient ops count in the layer they differentiate) with its ops,
        the collectives they need and those collectives' bytes per device, and the bytes
        per device of the tensors its ops produce."""
        return layer_stats(self)

    def advise(self, threshold_bytes: int = 0) -> list:
        """For every collective moving more than `threshold_bytes` per device, the change
        of one user sharding (in_shardings entry, annotation, out_shardings entry) that
        removes it or makes it cheaper, with the bytes and cost-model seconds it saves
        per step: a list of gspmd_tf.runtime.advice.Advice (print a.text()). Found by
        lowering again with alternatives (runtime/advice.py)."""
        return advise(self, threshold_bytes)

    def counts(self):
        """(annotated tensors, tensors that got a sharding by inference)."""
        annotated = len(self._annotated)
        inferred = sum(1 for i, node in enumerate(self.graph.nodes)
                       for k in range(len(node.out_shapes))
                       if (i, k) not in self._annotated
                       and not self.propagation.layouts[i][k].is_replicated)
        return annotated, inferred

    def memory(self) -> Memory:
        """Bytes each device holds (gspmd_tf.runtime.memory.Memory: arguments, variable
        shards, outputs and an estimated peak), read from the program's local shapes."""
        return program_memory(self)

    def as_text(self, dialect="hlo"):
        """The program as TF's XLA bridge compiles it: "hlo" gives the HLO module of the
        annotated global graph (the traced ops at global shapes, every tensor carrying
        its sharding as an XlaSharding annotation, for XLA's SPMD partitioner; what
        TPUStrategy compiles), made by tf.function(jit_compile=True) for this host's XLA
        device (XLA_CPU_JIT without accelerators). Nothing runs; abstract meshes work.
        "explicit" gives the SPMD program before the export pass, every layout change a
        gt.Reshard node; "spmd" the program after it, with its collectives (one node a
        line, backends.base.program_text)."""
        if dialect in ("explicit", "spmd"):
            return program_text(self.program.explicit if dialect == "explicit"
                                else self.program.graph)
        if dialect != "hlo":
            raise ShardingError(f"as_text({dialect!r}): give 'hlo', 'explicit' or 'spmd'")
        # imported on use: it loads the local backend, which `import gspmd_tf` does not
        from gspmd_tf.runtime.annotated import compiler_ir
        return compiler_ir(self, stage="hlo")

    def report(self, format="text", path=None, advise_bytes=None):
        """A readable table: every tensor's sharding, then the collectives and bytes.

        format="html" gives one self-contained HTML page (op graph colored by sharding,
        collectives, per-device memory, tensors); with `path` the report is also written
        to that file. With `advise_bytes` (a number) it ends with the advice for the
        collectives above that size (advise(): lowers alternatives, so it takes longer)."""
        if format not in ("text", "html"):
            raise ShardingError(f"report format {format!r}: use 'text' or 'html'")
        advice = None if advise_bytes is None else self.advise(advise_bytes)
        if format == "html":
            text = render_html(self, advice)
        else:
            text = self._text_report()
            if advice is not None:
                text += (f"\n\nadvice for the collectives above {advise_bytes} bytes:\n"
                         + ("\n".join(f"  {a.text()}" for a in advice)
                            or "  none: no single sharding change removes or shrinks one"))
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def _text_report(self):
        lines = [f"mesh {self.mesh!r}", "",
                 f"{'tensor':40s} {'op':24s} {'shape':18s} sharding"]
        for i, node in enumerate(self.graph.nodes):
            for k, shape in enumerate(node.out_shapes):
                layout = self.propagation.layouts[i][k]
                tag = " (annotated)" if (i, k) in self._annotated else ""
                name = node.name if k == 0 else f"{node.name}:{k}"
                lines.append(f"{name[:40]:40s} {node.op[:24]:24s} {str(shape):18s} "
                             f"{layout.to_spec()!r}{tag}")
        collectives = self.collectives()
        lines += ["", f"{'collective':20s} {'shape':20s} {'dtype':8s} {'bytes':>10s} group"]
        for c in collectives:
            group = c.groups[0] if c.groups else ()
            lines.append(f"{c.kind:20s} {str(c.shape):20s} {c.dtype.name:8s} {c.bytes:10d} "
                         f"{group} x{len(c.groups)} over {c.axes}")
            lines += [f"    for {origin.text()}" for origin in c.origins]
        total = sum(c.bytes for c in collectives)
        annotated, inferred = self.counts()
        lines += ["", f"{len(collectives)} collectives, {total} bytes per device",
                  f"{annotated} tensors annotated, {inferred} sharded by inference", ""]
        header, *rows = layer_table(self.layers())
        lines += [f"{header[0]:40s} {header[1]:>6s} {header[2]:>11s} {header[3]:>16s} "
                  f"{header[4]:>14s}"]
        # a long scope path keeps its end, the layer's own name ("...sequential_1/out_1")
        lines += [f"{layer if len(layer) <= 40 else '...' + layer[-37:]:40s} {ops:6d} "
                  f"{count:11d} {moved:16d} {held:14d}"
                  for layer, ops, count, moved, held in rows]
        if self.program.replicated_ops:
            lines.append("ran replicated (no rule): " + ", ".join(self.program.replicated_ops))
        lines += [f"placed on the mesh's axes: {note}" for note in self.placement_notes()]
        return "\n".join(lines)

    def auto_report(self) -> str:
        """What the auto-sharding search chose for each gt.AUTO entry, with its modelled
        cost and every alternative's, cheapest first, then what pins the plan: the
        in_shardings (and out_shardings), and the activations to annotate with
        gt.mesh_split where propagation from those would lay them out otherwise
        (autoshard/pinning.py). Returns the text (print it)."""
        plan = self.auto_plan
        if plan is None:
            raise ShardingError(f"{self.name} has no gt.AUTO entry: auto_report() shows "
                                "the plan the search chose for AUTO in/out_shardings")
        pinned = tuple(l.to_spec() for l in self.program.input_layouts[:self.num_args])
        lines = [plan.text(), "", f"pin the plan with in_shardings={pinned!r}"]
        if plan.output_layouts:
            lines.append("and out_shardings=" + repr(tuple(
                l.to_spec() for l in self.program.output_layouts)))
        outputs = {self.graph.outputs[j] for j in plan.output_layouts}  # not seeds
        seeds = {ref: self.propagation.layout(ref) for ref in self._annotated
                 if ref not in outputs or ref in self.graph.inputs}
        hints, left = activation_hints(self.graph, self.mesh, plan.layouts, seeds,
                                       traced_knobs(self.source_graph, self.graph))
        if hints:
            lines += ["and these activations with gt.mesh_split(tensor, mesh, spec) where "
                      "the function makes them (propagation from the shardings above lays "
                      "them out otherwise):"]
            lines += hint_lines(self.graph, hints, self.source_line)
        if left:
            lines.append(f"({left} more tensors of the plan differ after {ROUNDS} rounds of "
                         "annotations: the pinned program may move other bytes)")
        return "\n".join(lines)

    def compile(self):
        """The runnable program (built once): run(inputs[i][d]) -> outputs[j][d]."""
        if self.mesh.is_abstract:
            raise ShardingError("this function was lowered for an abstract mesh: use "
                                "gt.Mesh.create(...) to run it")
        if self._run is None:
            self._run = self.options.backend_factory(self.mesh).compile(self.program.graph,
                                                                        name=self.name)
        return self._run


def _graphs(graph):
    """`graph` and every region graph inside it."""
    yield graph
    for node in graph.nodes:
        for region in node.regions:
            yield from _graphs(region)


def _with_graphs(graph):
    """(graph, node) for every node of `graph` and of its regions, in ir.walk order."""
    for node in graph.nodes:
        yield graph, node
        for region in node.regions:
            yield from _with_graphs(region)

