"""The backend protocol: an SPMD program in, a Compiled program over per-device shards
out; each backend says what it can do in a Capabilities record.

A backend (Backend) is built for one mesh with devices. compile(program, name) returns
a Compiled: called with inputs[i][d] (the shard of program input i on device id d) it
returns outputs[j][d]; cost_analysis(), memory() and as_text() describe it without
running it. The backends are peers behind this protocol (backends/__init__.py):
LocalBackend (every op on TF's kernels), XlaBackend (the compute between collectives
compiled by XLA), AutoBackend (one of the two per program, by their cost models) and
XlaBridgeBackend (the TPU route: the whole annotated global program, compiled by XLA
behind TF's bridge; capabilities.whole_program).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional, Sequence

import tensorflow as tf

from gspmd_tf.cost_model import CostModel
from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Graph
from gspmd_tf.graph.text import program_text
from gspmd_tf.registry import CONVOLUTION, bytes_touched, dense_bytes, has_trait, multiply_adds

INPUT = "gt.Input"
SHARD_INDEX = "gt.ShardIndex"
ALL_REDUCE = "gt.AllReduce"
ALL_GATHER = "gt.AllGather"
REDUCE_SCATTER = "gt.ReduceScatter"
ALL_TO_ALL = "gt.AllToAll"
PERMUTE = "gt.Permute"
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, PERMUTE)
# the collective kind (XLA's name, as cost_model and gt.Collective name them) of each op
COLLECTIVE_KINDS = {ALL_REDUCE: "all-reduce", ALL_GATHER: "all-gather",
                    REDUCE_SCATTER: "reduce-scatter", ALL_TO_ALL: "all-to-all",
                    PERMUTE: "collective-permute"}


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, read by whoever must choose or price (the default
    backend's choice, the combiner; later the cost model).

    copy_collectives: collectives among CPU devices of this process are cross-device
        reads (no fixed cost per collective), not TF's collective ops.
    several_workers: runs meshes spanning several worker processes.
    compiles_segments: the compute between collectives is compiled (by XLA).
    device_kinds: the device types it runs on ("CPU", "GPU", "TPU").
    native_reduce_scatter: a reduce-scatter is one collective; False: an all-reduce
        and a slice (TF's collective ops have no CPU reduce-scatter), twice the traffic.
    semantics: "tf" (every op on TF's kernels: TF's values) or "xla" (compiled by XLA:
        XLA's rounding; ops whose XLA values differ from TF's still run on TF's kernels,
        see registry.xla_numerics_differ).
    whole_program: compiles the whole global program for XLA's SPMD partitioner (the
        annotated graph, runtime/annotated.GlobalProgram; global values in and out),
        not the per-device SPMD program.
    cost_model: the backend's CostModel of its mesh (gspmd_tf/cost_model.py: its links,
        native_reduce_scatter, its kernels' compute rates), which the partitioner's
        planner and combiner, the opt-in backend choice and the scheduler read; None:
        CostModel.for_mesh with this record's native_reduce_scatter."""

    copy_collectives: bool
    several_workers: bool
    compiles_segments: bool
    device_kinds: frozenset
    native_reduce_scatter: bool
    semantics: str
    whole_program: bool = False
    cost_model: Optional[CostModel] = None


class Backend(abc.ABC):
    """Lowers SPMD programs for one concrete mesh.

    An SPMD program is one gspmd_tf.graph.ir.Graph with LOCAL shapes, the same for every
    device (see docs/INTERNALS.md, "Contract: SPMD program"); a backend emits it once per device.
    """

    def __init__(self, mesh):
        if mesh.is_abstract:
            raise ShardingError(
                f"{type(self).__name__} needs a mesh with devices, got {mesh!r}; build it "
                "with gt.Mesh.create")
        self.mesh = mesh

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend can do on its mesh (Capabilities)."""

    @abc.abstractmethod
    def compile(self, program: Graph, name: Optional[str] = None) -> "Compiled":
        """Builds `program` once; returns its Compiled.

        `name` (the user's function, as errors should call it) names the program in
        errors.
        """

    @property
    def cost_model(self) -> CostModel:
        """The one model every cost decision about this backend's programs reads: its
        capabilities' cost_model, else CostModel.for_mesh(mesh) with its
        native_reduce_scatter."""
        capabilities = self.capabilities
        if capabilities.cost_model is not None:
            return capabilities.cost_model
        return CostModel.for_mesh(self.mesh,
                                  native_reduce_scatter=capabilities.native_reduce_scatter)

    def all_reduce_combine_bytes(self, in_region: bool) -> Optional[int]:
        """The largest all-reduce (operand bytes per device) the partitioner's combiner
        should merge with others (spmd/combine.py) in this backend's programs: at the
        top level, or inside control-flow bodies (`in_region`); 0 for none, None for
        the combiner's default. None here, on every backend: a program's all-reduces
        are combined as XLA combines them whatever runs them, so a step's collectives
        are the same on every backend (copy collectives included, where a combined
        all-reduce costs a flatten, a concat, a split and a reshape per member more
        than separate ones: benchmarks/RESULTS.md §14.10)."""
        return None


class Compiled(abc.ABC):
    """A program built by a backend: `program` (the SPMD program) runs when called."""

    program: Optional[Graph] = None
    # Whether the program may be given one handle for every device of a class of a
    # gt.Variable's copy owners (replicas.copy_owners): it then reads and writes each
    # variable of a class on its owner only. Otherwise every device gets a handle of its
    # own (the caller makes private copies, runtime/variables.py).
    shares_variable_copies: bool = False

    @abc.abstractmethod
    def __call__(self, inputs: Sequence[Sequence]) -> list:
        """outputs[j][d] of program output j on device id d (None on devices of other
        workers), from inputs[i][d], the shard of program input i on device id d
        (tensors or arrays; only those of this process's devices are read)."""

    def cost_analysis(self) -> dict:
        """What one device's program does, from the program and the op contracts:
        {"multiply_adds": of its dots and convolutions (a loop body counted once),
        "collective_bytes": the operand bytes of its collectives, "collectives": how
        many}."""
        return program_cost(self.program)

    def memory(self) -> dict:
        """Bytes one device's program holds for its arguments and results:
        {"argument_bytes", "output_bytes"}."""
        return {"argument_bytes": sum(dense_bytes(node.out_shapes[0], node.out_dtypes[0])
                                      for node in program_inputs(self.program)),
                "output_bytes": sum(dense_bytes(self.program.shape(ref), self.program.dtype(ref))
                                    for ref in self.program.outputs)}

    def as_text(self) -> str:
        """The SPMD program as text (program_text)."""
        return program_text(self.program)


def collectives_are_copies(mesh, copy_collectives: bool) -> bool:
    """Whether a backend emitting copy collectives when `copy_collectives` makes the
    collectives outside control-flow bodies on `mesh` copies (every device a CPU of this
    process): an all-reduce one AddN, a reduce-scatter a true one (each member sums its
    chunk); TF's collective ops otherwise (a reduce-scatter an all-reduce and a slice)."""
    return bool(copy_collectives) and mesh.is_fully_addressable and \
        mesh_device_kinds(mesh) == {"CPU"}


def mesh_device_kinds(mesh) -> set:
    """The device types of `mesh`'s devices ("CPU", "GPU", "TPU"), upper case."""
    return {(tf.DeviceSpec.from_string(name).device_type or "CPU").upper()
            for name in mesh.devices}


def program_inputs(program: Graph) -> list:
    """The gt.Input nodes of `program`, indexed by their `index` param.

    Raises ShardingError when the indices are not exactly 0..n-1.
    """
    nodes = {}
    for node in program.nodes:
        if node.op == INPUT:
            nodes.setdefault(node.params["index"], []).append(node)
    if sorted(nodes) != list(range(len(nodes))) or any(len(v) > 1 for v in nodes.values()):
        raise ShardingError(
            f"SPMD program inputs have indices {sorted(nodes)}: each index 0..n-1 must "
            "appear on exactly one gt.Input node")
    return [nodes[i][0] for i in range(len(nodes))]


def program_cost(program: Graph) -> dict:
    """Compiled.cost_analysis of `program` (its bodies included)."""
    cost = {"multiply_adds": 0, "collective_bytes": 0, "collectives": 0}
    for graph, node in nodes_with_graphs(program):
        cost["multiply_adds"] += node_multiply_adds(graph, node)
        if node.op in COLLECTIVES:
            cost["collectives"] += 1
            cost["collective_bytes"] += dense_bytes(graph.shape(node.inputs[0]),
                                               graph.dtype(node.inputs[0]))
    return cost


def nodes_with_graphs(graph: Graph):
    """(graph, node) for every node of `graph` and of its control-flow bodies, each body
    once, a node with the graph whose shapes it reads."""
    for node in graph.nodes:
        yield graph, node
        for region in node.regions:
            yield from nodes_with_graphs(region)


def node_multiply_adds(graph: Graph, node) -> int:
    """registry.multiply_adds of `node`, its input shapes read from `graph`."""
    return multiply_adds(node, [graph.shape(ref) for ref in node.inputs])


def node_seconds(graph: Graph, node, model: CostModel) -> float:
    """Seconds one device spends on `node` (its input shapes read from `graph`) by
    `model`: a collective's collective_seconds over its axes (a permute: its pairs, no
    axes); a program input or shard index nothing; any other op one kernel, its
    multiply-adds (registry.multiply_adds; a CONVOLUTION op at the convolution rate)
    or, without any, the bytes it reads and writes (registry.bytes_touched)."""
    if node.op in COLLECTIVES:
        operand = node.inputs[0]
        return model.collective_seconds(
            COLLECTIVE_KINDS[node.op], dense_bytes(graph.shape(operand), graph.dtype(operand)),
            tuple(node.params.get("axes", ())))
    if node.op in (INPUT, SHARD_INDEX):
        return 0.0
    count = node_multiply_adds(graph, node)
    if count:
        return model.compute_seconds(count, convolution=has_trait(node.op, CONVOLUTION))
    return model.compute_seconds(0, bytes_touched=bytes_touched(
        node, [graph.shape(ref) for ref in node.inputs],
        [graph.dtype(ref) for ref in node.inputs]))


def program_seconds(program: Graph, model: CostModel) -> float:
    """Seconds one device spends on `program` by `model`: node_seconds summed over its
    nodes and its bodies' (each body once)."""
    return sum(node_seconds(graph, node, model) for graph, node in nodes_with_graphs(program))
