"""One cost model for every communication choice: an alpha-beta model per mesh axis.

A collective over a group of mesh axes costs a fixed latency (alpha: launch, rendezvous,
round trip) plus the bytes each device sends over the group's bandwidth (1 / beta), as
XLA auto-sharding's ClusterEnvironment prices collectives per mesh dim and PyTorch
DTensor's redistribute_cost prices them per mesh dim from its MeshTopoInfo. Each mesh
axis runs over one class of link: "cross-worker" when the groups along it span devices of
several worker processes (TF device names with different job or task), "intra-process"
otherwise. A group of several axes runs at its slowest link.

Who reads it: the reshard planner ranks plans by `collective_seconds` (spmd/planner.py),
the all-reduce combiner merges all-reduces below `combine_threshold_bytes` (the size
below which latency dominates; spmd/combine.py), the opt-in backend choice compares a
program's seconds on each backend's model (backends/auto.py) and the local backend's
scheduler orders nodes by when their inputs are ready (backends/schedule.py), both by
`compute_seconds` and `collective_seconds` per node (backends/base.py `node_seconds`).
Each backend supplies its model (Backend.cost_model): what it emits
(`native_reduce_scatter` False, what TF's collectives do: an all-reduce and a local
slice, twice the traffic of a ring reduce-scatter; True where it does a true one) and
what its kernels compute at (TF's kernels one kernel launch per op; XLA:CPU's compiled
segments none per op but slower dots and convolutions).

This module imports only mesh-level code, so every stage may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import Mesh, SubAxis


@dataclass(frozen=True)
class Link:
    """One class of links between devices: `latency` in seconds (what a collective costs
    however small) and `bandwidth` in bytes per second one device sends."""

    latency: float
    bandwidth: float

    @property
    def latency_bytes(self) -> float:
        """Bytes this link sends in one latency: below that size a collective is
        latency-bound."""
        return self.latency * self.bandwidth


# Defaults, from benchmarks/RESULTS.md (2 cores, 8 logical CPU devices, loaded machine).
# Intra-process (§8, "All-reduce combiner"): an 8-device all-reduce of 1 KiB cost
# ~0.43 ms of a step, one of 64 KiB ~0.54 ms, so ~1 GB/s and a latency of a few hundred
# microseconds; taken as 2^30 B/s and 2^-12 s (244 us, below the loaded machine's
# 0.43 ms), whose product, 256 KiB, is where §8 measured combining to stop paying
# (1 KiB and 64 KiB gradients merged: 5x and 3x; 1 MiB: nothing). Powers of two keep the
# planner's sums exact.
INTRA_PROCESS = Link(latency=2.0 ** -12, bandwidth=2.0 ** 30)
# Cross-worker (TF's gRPC collectives over loopback; §12.1: ~2.6-2.8 ms per
# collective-permute of 8 KiB, latency-bound; §12: the FFN step's 8 MiB of gradient
# all-reduce per device over the worker axis cost ~120-180 ms more than in one process,
# ~50-70 MB/s): 2.5 ms and 2^26 B/s (64 MiB/s), 16x slower than intra-process.
CROSS_WORKER = Link(latency=2.5e-3, bandwidth=2.0 ** 26)
# Compute (RESULTS §4: the FFN training step, ~5.2e10 multiply-adds, took ~570 ms on one
# TF CPU device using both cores, ~9e10 per second; 8 logical devices share them, ~1.1e10
# each) and the fixed cost of one TF kernel (§14: ~11 us per _Send kernel, 130-200 us
# per small einsum; the smaller: a floor).
MULTIPLY_ADDS_PER_SECOND = 1.1e10
KERNEL_SECONDS = 1.1e-5
# Bytes an op without multiply-adds (elementwise, data movement) reads and writes per
# second (registry.bytes_touched): an elementwise add of 16 MiB vectors moved 0.31x and
# 0.39x as many bytes per second as a 1024^3 matmul did multiply-adds, in two runs of
# benchmarks/kernel_rates.py at load ~2 (RESULTS §17.1; a transpose 0.07x, a copied
# slice 0.6x: one memory rate is a simplification).
MEMORY_BYTES_PER_SECOND = 0.35 * MULTIPLY_ADDS_PER_SECOND
# XLA:CPU's compiled segments, against TF's oneDNN kernels on the same devices (RESULTS
# §14.9, §14.11): the FFN train steps, whose time is their dots, ran 1.4-1.67x slower
# under XLA at widths 64-256 (2.1x at 512): dots at 1/1.5 of TF's rate; the ResNet50 step
# 2.6x slower: convolutions at 1/2.6. An op inside a segment launches no kernel of its
# own (XLA_SEGMENT_KERNEL_SECONDS). With TF's 11 us per kernel, a program of dots
# averaging 2 x 11e-6 x 1.1e10 = 2.4e5 multiply-adds per op costs the same either way:
# between the Transformer LM (<= 2.1e5, faster under XLA) and the narrow FFN (4.4e5,
# slower), the crossover §14.11 measured.
XLA_CPU_MULTIPLY_ADDS_PER_SECOND = MULTIPLY_ADDS_PER_SECOND / 1.5
XLA_CPU_CONVOLUTION_MULTIPLY_ADDS_PER_SECOND = MULTIPLY_ADDS_PER_SECOND / 2.6
XLA_SEGMENT_KERNEL_SECONDS = 0.0

KINDS = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def ring_bytes(kind: str, operand_bytes: int, group: int) -> int:
    """Bytes one device sends in collective `kind` over `group` devices whose operand
    is `operand_bytes` per device, by ring algorithms (a true reduce-scatter)."""
    if kind == "all-gather":
        return (group - 1) * operand_bytes
    if kind == "all-reduce":
        return 2 * (group - 1) * operand_bytes // group
    if kind == "collective-permute":
        return operand_bytes
    if kind in ("all-to-all", "reduce-scatter"):  # all but one k-th of the operand leaves
        return (group - 1) * operand_bytes // group
    raise ShardingError(f"unknown collective kind {kind!r}: use one of {list(KINDS)}")


class CostModel:
    """Seconds of collectives and compute on one mesh (see the module doc).

    `axis_sizes` maps each mesh axis to its size, `links` each axis to its Link (axes not
    listed are intra-process). `native_reduce_scatter`: whether the backend emits a true
    reduce-scatter (else an all-reduce and a slice). Compute: `multiply_adds_per_second`
    of dots, `convolution_multiply_adds_per_second` of convolutions (None: the dots'),
    `memory_bytes_per_second` an op without multiply-adds reads and writes (its
    registry.bytes_touched), `kernel_seconds` per kernel launched. Immutable and hashable: the planner's caches key on it. Build one
    for a mesh with `CostModel.for_mesh`.
    """

    __slots__ = ("axis_sizes", "links", "native_reduce_scatter", "multiply_adds_per_second",
                 "convolution_multiply_adds_per_second", "memory_bytes_per_second",
                 "kernel_seconds", "_key", "_hash")

    def __init__(self, axis_sizes: Mapping[str, int], links: Mapping[str, Link] | None = None,
                 native_reduce_scatter: bool = False,
                 multiply_adds_per_second: float = MULTIPLY_ADDS_PER_SECOND,
                 kernel_seconds: float = KERNEL_SECONDS,
                 convolution_multiply_adds_per_second: float | None = None,
                 memory_bytes_per_second: float = MEMORY_BYTES_PER_SECOND):
        links = dict(links or {})
        unknown = set(links) - set(axis_sizes)
        if unknown:
            raise ShardingError(f"CostModel: links name axes {sorted(unknown)} that are not "
                                f"mesh axes {list(axis_sizes)}")
        sizes = tuple((a, int(n)) for a, n in axis_sizes.items())
        link_of = tuple((a, links.get(a, INTRA_PROCESS)) for a, _ in sizes)
        if convolution_multiply_adds_per_second is None:
            convolution_multiply_adds_per_second = multiply_adds_per_second
        rates = (("multiply_adds_per_second", multiply_adds_per_second),
                 ("convolution_multiply_adds_per_second",
                  convolution_multiply_adds_per_second),
                 ("memory_bytes_per_second", memory_bytes_per_second))
        for name, value in (*rates, *((f"{a}'s bandwidth", l.bandwidth) for a, l in link_of)):
            if not value > 0:
                raise ShardingError(f"CostModel: {name} is {value!r}; give a rate above 0")
        if not kernel_seconds >= 0:
            raise ShardingError(f"CostModel: kernel_seconds is {kernel_seconds!r}; give "
                                "seconds >= 0")
        object.__setattr__(self, "axis_sizes", dict(sizes))
        object.__setattr__(self, "links", dict(link_of))
        object.__setattr__(self, "native_reduce_scatter", bool(native_reduce_scatter))
        for name, value in rates:
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "kernel_seconds", float(kernel_seconds))
        object.__setattr__(self, "_key", (sizes, link_of, self.native_reduce_scatter,
                                          *(float(value) for _, value in rates),
                                          self.kernel_seconds))
        object.__setattr__(self, "_hash", hash(self._key))  # every planner cache lookup

    @classmethod
    def for_mesh(cls, mesh: Mesh, intra: Link = INTRA_PROCESS, cross: Link = CROSS_WORKER,
                 **options) -> "CostModel":
        """The model of `mesh`: an axis runs over `cross` links when one of its groups
        holds devices of two workers (Mesh.workers), else over `intra` ones. `options` as
        for CostModel (native_reduce_scatter, ...)."""
        links = {axis: cross if _spans_workers(mesh, axis) else intra
                 for axis in mesh.axis_names}
        return cls(dict(zip(mesh.axis_names, mesh.shape)), links, **options)

    def __setattr__(self, name, value):
        raise AttributeError(f"CostModel is immutable (tried to set {name!r})")

    def __eq__(self, other):
        return isinstance(other, CostModel) and self._key == other._key

    def __hash__(self):
        return self._hash

    def __repr__(self):
        axes = ", ".join(f"{a}={n} ({self.links[a].latency:g} s, {self.links[a].bandwidth:g} B/s)"
                         for a, n in self.axis_sizes.items())
        scatter = "native" if self.native_reduce_scatter else "all-reduce + slice"
        return f"<CostModel {axes}; reduce-scatter: {scatter}>"

    def link(self, axes: Iterable) -> Link:
        """The link a group over `axes` (names or SubAxis) runs at: its slowest axis's
        (the largest latency, the smallest bandwidth). A sub-axis runs at its axis's."""
        links = [self.links[getattr(a, "axis", a)] for a in axes]
        if not links:
            return INTRA_PROCESS
        return Link(max(l.latency for l in links), min(l.bandwidth for l in links))

    def group_size(self, axes: Iterable) -> int:
        """Devices in a group over `axes` (names or SubAxis)."""
        size = 1
        for a in axes:
            size *= a.size if isinstance(a, SubAxis) else self.axis_sizes[a]
        return size

    def wire_bytes(self, kind: str, operand_bytes: int, axes: Sequence) -> int:
        """Bytes one device sends for collective `kind` over `axes` as the backend emits
        it: a reduce-scatter that is not native is an all-reduce (then a local slice)."""
        if kind == "reduce-scatter" and not self.native_reduce_scatter:
            kind = "all-reduce"
        return ring_bytes(kind, operand_bytes, self.group_size(axes))

    def collective_seconds(self, kind: str, operand_bytes: int, axes: Sequence,
                           latency_weight: float = 1.0) -> float:
        """Seconds of collective `kind` over mesh `axes` with `operand_bytes` per device:
        latency (times `latency_weight`) plus wire bytes over bandwidth, both of the
        group's slowest link."""
        link = self.link(axes)
        return (latency_weight * link.latency
                + self.wire_bytes(kind, operand_bytes, axes) / link.bandwidth)

    def compute_seconds(self, multiply_adds: float, kernels: int = 1,
                        convolution: bool = False, bytes_touched: float = 0) -> float:
        """Seconds one device takes for `multiply_adds` (of a convolution when
        `convolution`: at its rate) and `bytes_touched` read and written without
        multiply-adds, in `kernels` kernels (each with a fixed launch cost)."""
        rate = (self.convolution_multiply_adds_per_second if convolution
                else self.multiply_adds_per_second)
        return (kernels * self.kernel_seconds + multiply_adds / rate
                + bytes_touched / self.memory_bytes_per_second)

    def combine_threshold_bytes(self, axes: Sequence | None = None) -> int:
        """The all-reduce size (operand bytes per device) below which latency dominates:
        latency x bandwidth of the link of `axes` (every mesh axis by default, so the
        slowest link): the all-reduce combiner merges those up to this size."""
        axes = tuple(self.axis_sizes) if axes is None else axes
        return int(self.link(axes).latency_bytes)


def _spans_workers(mesh: Mesh, axis: str) -> bool:
    """True when a group of devices along `axis` holds devices of two workers."""
    if not mesh.workers.any():  # one worker (the common case): no group tables needed
        return False
    held = mesh.workers[mesh.groups((axis,))]
    return bool((held != held[:, :1]).any())
