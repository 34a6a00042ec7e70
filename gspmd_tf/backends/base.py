"""The backend interface: an SPMD program in, a callable over per-device shards out."""

from __future__ import annotations

import abc

from gspmd_tf.errors import ShardingError

INPUT = "gt.Input"
SHARD_INDEX = "gt.ShardIndex"
ALL_REDUCE = "gt.AllReduce"
ALL_GATHER = "gt.AllGather"
REDUCE_SCATTER = "gt.ReduceScatter"
ALL_TO_ALL = "gt.AllToAll"
PERMUTE = "gt.Permute"


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

    @abc.abstractmethod
    def compile(self, program, name=None):
        """Builds `program` once; returns run(inputs) -> outputs.

        inputs[i][d] is the shard of program input i (gt.Input index i) for device id d;
        outputs[j][d] is the shard of program.outputs[j] on device id d. `name` (the
        user's function, as errors should call it) names the program in errors.
        """

    def all_reduce_combine_bytes(self, in_region):
        """The largest all-reduce (operand bytes per device) the partitioner's combiner
        should merge with others (spmd/combine.py) in this backend's programs: at the
        top level, or inside control-flow bodies (`in_region`); 0 for none, None for
        the combiner's default. What pays depends on what an all-reduce costs here."""
        return None


def program_inputs(program):
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
