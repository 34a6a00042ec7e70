"""Lowered: a partitioned function for one input signature, before or after compiling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gspmd_tf.backends.base import COLLECTIVE_KINDS
from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Graph
from gspmd_tf.propagation.propagate import Propagation
from gspmd_tf.runtime.explain import explain
from gspmd_tf.runtime.html_report import render_html
from gspmd_tf.runtime.memory import Memory, program_memory
from gspmd_tf.runtime.options import LowerOptions
from gspmd_tf.sharding import Sharding
from gspmd_tf.spmd.partitioner import SpmdProgram
from gspmd_tf.spmd.program import COLLECTIVES


@dataclass(frozen=True)
class Collective:
    """One collective of the SPMD program, as XLA names it.

    `shape`/`dtype`/`bytes` describe one device's operand; `groups` lists the device ids
    that take part together (for collective-permute: the (source, target) pairs).
    """

    kind: str
    shape: tuple
    dtype: object
    bytes: int
    groups: tuple
    axes: tuple


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
    a program lowered from a SavedModel signature (`python -m gspmd_tf inspect`).
    """

    def __init__(self, options: LowerOptions, graph: Graph, propagation: Propagation,
                 program: SpmdProgram, *, num_args: int, annotated: frozenset,
                 stage_seconds: dict, committed_args: frozenset = frozenset(),
                 structured_outputs=None, named_inputs: tuple = ()):
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
        self._num_args = num_args
        self._annotated = annotated
        self._run = None  # the compiled program, built on first use
        self._consumers = None  # graph.consumers(), made on first use by explain()

    def _sharding(self, layout):
        return Sharding.from_layout(self.mesh, layout)

    @property
    def input_shardings(self):
        """gt.Sharding of every flat argument, in order."""
        return [self._sharding(l) for l in self.program.input_layouts[:self._num_args]]

    @property
    def output_shardings(self):
        """gt.Sharding of every flat output, in order."""
        return [self._sharding(l) for l in self.program.output_layouts]

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
        return explain(self, name)

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
            out.append(Collective(COLLECTIVE_KINDS[node.op], tuple(shape), dtype,
                                  int(np.prod(shape, dtype=np.int64)) * dtype.size, groups,
                                  tuple(node.params.get("axes", ()))))
        return out

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
        device (XLA_CPU_JIT without accelerators). Nothing runs; abstract meshes work."""
        if dialect != "hlo":
            raise ShardingError(f"as_text({dialect!r}): the only dialect is 'hlo'")
        # imported on use: it loads the local backend, which `import gspmd_tf` does not
        from gspmd_tf.runtime.annotated import compiler_ir
        return compiler_ir(self, stage="hlo")

    def report(self, format="text", path=None):
        """A readable table: every tensor's sharding, then the collectives and bytes.

        format="html" gives one self-contained HTML page (op graph colored by sharding,
        collectives, per-device memory, tensors); with `path` the report is also written
        to that file."""
        if format not in ("text", "html"):
            raise ShardingError(f"report format {format!r}: use 'text' or 'html'")
        if format == "html":
            text = render_html(self)
        else:
            text = self._text_report()
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
        total = sum(c.bytes for c in collectives)
        annotated, inferred = self.counts()
        lines += ["", f"{len(collectives)} collectives, {total} bytes per device",
                  f"{annotated} tensors annotated, {inferred} sharded by inference"]
        if self.program.replicated_ops:
            lines.append("ran replicated (no rule): " + ", ".join(self.program.replicated_ops))
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


def _with_graphs(graph):
    """(graph, node) for every node of `graph` and of its regions, in ir.walk order."""
    for node in graph.nodes:
        yield graph, node
        for region in node.regions:
            yield from _with_graphs(region)

