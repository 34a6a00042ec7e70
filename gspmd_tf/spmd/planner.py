"""The reshard planner: which steps move a tensor from one layout to another, and their cost.

`plan(src, dst, shape, dtype, mesh)` returns a tuple of typed steps (LocalSlice,
CollectivePermute, AllToAll, AllGather, Broadcast, ReduceScatter, AllReduce) that turn
the shards of `src` into the shards of `dst`; `cost(steps)` counts the bytes each device
sends (ring algorithms), `seconds(steps, model)` prices them on a CostModel
(gspmd_tf/cost_model.py: links per mesh axis, reduce-scatter as the backend emits it);
spmd/reshard.py emits them.
The planner is pure (no TF, no builder) and cached, so the partitioner can price
candidate layouts cheaply.

Search: Dijkstra over layouts, from `src` to `dst`, with moves that each keep every shard
exact, uneven dims included (see `nests`): slice axes into a dim locally, gather a dim's
minor axes, all-to-all a dim's minor axes onto another dim (one collective over several
axes when they move together, and over several dims' when they move at once),
collective-permute to a layout with the same shard counts, reduce-scatter or all-reduce
pending partial sums, take a split dim of one element whole from its first shard
(Broadcast). The cheapest sequence wins; among equal costs, fewer collectives,
then fewer steps. One more search per way of cutting an axis of the reshard in two
(`_sub_axis_splits`) may find a cheaper plan over parts of an axis (mesh.SubAxis), as
XLA's (docs/DESIGN_LOG.md, "Sub-axis steps"); where `src` or `dst` names sub-axes, every
search runs on layouts with those axes cut into parts. Shrinking moves cost nothing, so
the search slices before it gathers (Shardy's order: slice, permute, all-to-all,
all-gather), keeping gathered tensors small. Where axes run over different links (one
spanning workers), the same bytes cost more on the slower one: plans keep to fast axes.

Uneven dims: a dim of n split k ways has shards of ceil(n / k) elements, shard i holding
[i * ceil(n/k), (i + 1) * ceil(n/k)) of the global dim and arbitrary padding past n.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass, field, replace

from gspmd_tf.collective_dtypes import carries
from gspmd_tf.cost_model import CostModel, ring_bytes
from gspmd_tf.layout import (Layout, axis_parts, ceil_div, cut_axes, merged_axes,
                             merged_layout, sub_axes_of)
from gspmd_tf.mesh import SubAxis

# The share of a collective's latency the planner counts, a tie-breaker: XLA ranks
# reshards by bytes (its choices, tests/test_xla_match.py, are at a few KiB, where the whole
# latency would rank plans by their count alone); 2^-8 of it is 1 KiB per collective.
LATENCY_WEIGHT = 2.0 ** -8
# the most single-dim all-to-alls the search joins into one (each joined set is a move)
_MAX_JOINED = 3


def nests(n, k_outer, k_inner):
    """True when splitting each of the k_outer shards of a dim of n further into k_inner
    gives exactly its k_outer * k_inner shards (always for an unsplit dim: pad, then split).
    Examples: n=7 split 2 then 2: the shards of 4 cut in two are the 4-way shards of 2;
    n=10 split 2 then 4: the shards of 5 are not four 8-way shards of 2."""
    return k_outer == 1 or ceil_div(n, k_outer) == k_inner * ceil_div(n, k_outer * k_inner)


# ------------------------------------------------------------------------ steps

class _Step:
    """What every step shares: `apply`, the layout after the step; `kind`, the XLA name
    of its collective (None for a local slice)."""

    kind = None

    @property
    def group_axes(self):
        """The mesh axes of the step's group."""
        return self.axes

    @property
    def link_axes(self):
        """The axes whose links the step runs over (its group's)."""
        return self.group_axes

    def apply(self, layout):
        """The layout after this step. A step may name sub-axes (SubAxis): the layout's
        whole axes are cut into them first, and sub-axes that make up a whole axis again
        are merged back after, so layouts between plans name whole axes only."""
        named = [a for a in self.group_axes if isinstance(a, SubAxis)]
        if not named:
            return self.move(layout)
        return merged_layout(self.move(cut_axes(layout, named)))


@dataclass(frozen=True)
class LocalSlice(_Step):
    """Split dim `dim` further over `axes` (appended, minor) by a local dynamic slice,
    padding the dim first when it is shorter than the slices."""

    dim: int
    axes: tuple
    bytes_in: int = 0
    group: int = 1

    def move(self, layout):
        """The layout after this step, the axes it names taken as they are."""
        return _set_dims(layout, {self.dim: layout.dims[self.dim] + self.axes})


@dataclass(frozen=True)
class AllGather(_Step):
    """Gather the minor `axes` of dim `dim` (uneven dims gathered whole are unpadded)."""

    kind = "all-gather"
    dim: int
    axes: tuple
    bytes_in: int = 0
    group: int = 1

    def move(self, layout):
        """The layout after this step, the axes it names taken as they are."""
        cd = layout.dims[self.dim]
        return _set_dims(layout, {self.dim: cd[:len(cd) - len(self.axes)]})


@dataclass(frozen=True)
class Broadcast(AllGather):
    """Gather a dim of one element split over all its `axes` from the first shard (the
    others hold padding): that shard, zeros on the others, all-reduced (XLA's picked
    element, kept split on its size-1 dim, moves so)."""

    kind = "all-reduce"


@dataclass(frozen=True)
class AllToAll(_Step):
    """Move the minor `axes` of dim `concat_dim` to the end of dim `split_dim`, and each
    (axes, concat_dim, split_dim) of `also` alike (all dims distinct): one all-to-all
    over the group of all their axes (split dims padded first when uneven), as XLA's
    all-to-all of several source and target dims at once."""

    kind = "all-to-all"
    axes: tuple
    concat_dim: int
    split_dim: int
    bytes_in: int = 0
    group: int = 1
    also: tuple = ()

    @property
    def moves(self):
        """Every (axes, concat_dim, split_dim) the step moves, in group order."""
        return ((self.axes, self.concat_dim, self.split_dim),) + self.also

    @property
    def group_axes(self):
        """The mesh axes of the step's group: each move's, in order."""
        return tuple(a for axes, _, _ in self.moves for a in axes)

    def move(self, layout):
        """The layout after this step, the axes it names taken as they are."""
        new = {}
        for axes, d1, d2 in self.moves:
            cd = layout.dims[d1]
            new[d1] = cd[:len(cd) - len(axes)]
            new[d2] = layout.dims[d2] + axes
        return _set_dims(layout, new)


@dataclass(frozen=True)
class CollectivePermute(_Step):
    """Every device takes the shard it needs from one other device: dims get new axes with
    the same shard counts (`dims` holds (dim, axes) pairs)."""

    kind = "collective-permute"
    dims: tuple
    bytes_in: int = 0
    group: int = 1
    # the axes the dims leave and those they take: the links data moves over (a split
    # over "w" permuted to one over "i" crosses "w"); not part of what the step is
    over: tuple = field(default=(), compare=False)

    @property
    def axes(self):
        """Mesh axes whose coordinates change hands."""
        return tuple(sorted({a for _, axes in self.dims for a in axes}, key=str))

    @property
    def link_axes(self):
        """The axes whose links the step runs over."""
        return self.over or self.axes

    def move(self, layout):
        """The layout after this step, the axes it names taken as they are."""
        return _set_dims(layout, dict(self.dims))


@dataclass(frozen=True)
class ReduceScatter(_Step):
    """Sum (or reduce_op) over the pending partial `axes`, keeping this device's chunk of
    dim `dim` (the axes appended to the dim, in this order); other partial axes stay
    pending."""

    kind = "reduce-scatter"
    dim: int
    axes: tuple
    bytes_in: int = 0
    group: int = 1

    def move(self, layout):
        """The layout after this step, the axes it names taken as they are."""
        dims = list(layout.dims)
        dims[self.dim] = dims[self.dim] + self.axes
        rest = tuple(a for a in layout.partial if a not in self.axes)
        return Layout(tuple(dims), rest, layout.reduce_op)


@dataclass(frozen=True)
class AllReduce(_Step):
    """Reduce the pending partial `axes`."""

    kind = "all-reduce"
    axes: tuple
    bytes_in: int = 0
    group: int = 1

    def move(self, layout):
        """The layout after this step, the axes it names taken as they are."""
        return Layout(layout.dims)


def _set_dims(layout, new):
    dims = tuple(new.get(d, axes) for d, axes in enumerate(layout.dims))
    return Layout(dims, layout.partial, layout.reduce_op)


# ------------------------------------------------------------------------ cost

@dataclass(frozen=True)
class Cost:
    """What a plan moves on one device: bytes sent by ring algorithms (to compare with
    XLA's plans; seconds() prices what the backend emits), per group of mesh axes the
    collective runs over, and the number of collectives."""

    bytes_by_axes: tuple   # ((axes, bytes), ...), one entry per collective
    collectives: int
    steps: int

    @property
    def bytes(self):
        """Total bytes moved per device."""
        return sum(b for _, b in self.bytes_by_axes)

    def __add__(self, other):
        return Cost(self.bytes_by_axes + other.bytes_by_axes,
                    self.collectives + other.collectives, self.steps + other.steps)


ZERO = Cost((), 0, 0)


def step_cost(step):
    """Bytes one step moves per device (ring algorithms; `bytes_in` is its operand)."""
    if step.kind is None:
        return Cost((), 0, 1)
    return Cost(((tuple(step.group_axes), ring_bytes(step.kind, step.bytes_in, step.group)),), 1, 1)


def cost(steps):
    """The Cost of a plan (a tuple of steps)."""
    total = ZERO
    for step in steps:
        total = total + step_cost(step)
    return total


def step_seconds(step, model: CostModel) -> float:
    """What the planner ranks a step by: `model`'s seconds for its collective (as the
    backend emits it), latency counted at LATENCY_WEIGHT; 0 for a local slice."""
    if step.kind is None:
        return 0.0
    return model.collective_seconds(step.kind, step.bytes_in, step.link_axes, LATENCY_WEIGHT)


def seconds(steps, model: CostModel) -> float:
    """The planner's price of a plan (a tuple of steps) on `model`: see step_seconds."""
    return sum(step_seconds(step, model) for step in steps)


# ------------------------------------------------------------------------ search

def plan(src, dst, shape, dtype, mesh, model: CostModel | None = None):
    """The cheapest exact steps from Layout `src` to Layout `dst` (no partial) for a
    global tensor of `shape` and `dtype`, priced by `model` (CostModel.for_mesh(mesh)
    by default); a tuple of step records."""
    # strings and handles have no fixed size: priced like 8-byte elements
    return _plan(src, dst, tuple(shape), dtype.size or 8, model or CostModel.for_mesh(mesh),
                 carries(dtype))


def plan_estimate(src, dst, shape, dtype, mesh, model: CostModel | None = None) -> float:
    """seconds(plan(...), model), cached: what the partitioner compares candidates by."""
    if src == dst:
        return 0.0
    return _plan_estimate(src, dst, tuple(shape), dtype.size or 8,
                          model or CostModel.for_mesh(mesh), carries(dtype))


@functools.lru_cache(maxsize=1 << 16)
def _plan_estimate(src, dst, shape, itemsize, model, summable):
    return seconds(_plan(src, dst, shape, itemsize, model, summable), model)


@functools.lru_cache(maxsize=1 << 16)
def _plan(src, dst, shape, itemsize, model, summable=True):
    assert not dst.partial, dst
    if src == dst:
        return ()
    return _candidates(src, dst, shape, itemsize, model, summable)[-1][1]


def _candidates(src, dst, shape, itemsize, model, summable=True):
    """[(key, steps)]: the cheapest plan over the axes the layouts name (whole mesh axes,
    and sub-axes where a layout names some: then every layout of the search holds that
    axis cut into parts at their bounds), then each plan with one of `_sub_axis_splits`
    that is cheaper than the ones before it (its steps name the whole axis where they
    take all of it; the last is the cheapest: a tie keeps the earlier); `model` prices
    the steps and gives the axes' sizes."""
    given = sub_axes_of(src) + sub_axes_of(dst)
    src, dst = cut_axes(src, given), cut_axes(dst, given)
    sizes = _cut_sizes(model.axis_sizes, given)
    found = [_search(src, dst, _Space(shape, itemsize, sizes, dst, summable), model)]
    for parts in _sub_axis_splits(src, dst, sizes):
        cut_dst = cut_axes(dst, parts)
        cheaper = _search(cut_axes(src, parts), cut_dst,
                          _Space(shape, itemsize, _cut_sizes(sizes, parts), cut_dst,
                                 summable), model,
                          bound=found[-1][0])
        if cheaper is not None:
            found.append(cheaper)
    return [(key, tuple(_whole_axes(step) for step in steps)) for key, steps in found]


def _cut_sizes(sizes, sub_axes):
    """{axis: devices} with each axis `sub_axes` cut replaced by its parts."""
    parts = axis_parts(sub_axes)
    out = {a: n for a, n in sizes.items() if a not in parts}
    out.update((p, p.size) for axis in parts.values() for p in axis)
    return out


def _sub_axis_splits(src, dst, sizes):
    """The ways to cut one mesh axis of a reshard in two (major part first) that the
    search tries beside the whole axes: an axis of s devices cut at t, where another axis
    the layouts use has t devices (1 < t < s, t divides s). The major part can then trade
    places with that axis in a permute, and the minor part move or be gathered alone, as
    XLA does (P(data, model) -> P(model, data) on 2x4: an all-to-all over model's minor
    half, then a permute trading data and model's major half)."""
    used = sorted({a for a in src.used_axes + dst.used_axes if isinstance(a, str)})
    seen = set()
    for x in used:
        for y in used:
            s, t = sizes[x], sizes[y]
            if 1 < t < s and s % t == 0 and (x, t) not in seen:
                seen.add((x, t))
                yield SubAxis(x, 1, t, s), SubAxis(x, t, s // t, s)


def _whole_axes(step):
    """`step` naming whole axes where it names all parts of one, in order."""
    if isinstance(step, CollectivePermute):
        return replace(step, dims=tuple((d, merged_axes(axes)) for d, axes in step.dims))
    if isinstance(step, AllToAll):
        step = replace(step, also=tuple((merged_axes(axes), d1, d2)
                                        for axes, d1, d2 in step.also))
    return replace(step, axes=merged_axes(step.axes))


def _search(src, dst, space, model, bound=None):
    """(key, steps): the cheapest steps from `src` to `dst` among `space`'s moves, keyed
    by (step_seconds on `model`, collectives, steps); None when none is keyed below
    `bound`."""
    counter = itertools.count()
    start = (0.0, 0, 0)
    best = {src: start}
    heap = [(start, next(counter), src, ())]
    while heap:
        key, _, layout, steps = heapq.heappop(heap)
        if layout == dst:
            return key, steps
        if best.get(layout, key) < key:
            continue
        for step in space.moves(layout):
            collective = step.kind is not None
            new_key = (key[0] + step_seconds(step, model), key[1] + collective, key[2] + 1)
            if bound is not None and new_key >= bound:
                continue
            nxt = step.move(layout)
            if nxt not in best or new_key < best[nxt]:
                best[nxt] = new_key
                heapq.heappush(heap, (new_key, next(counter), nxt, steps + (step,)))
    if bound is not None:
        return None
    raise AssertionError(f"no reshard plan from {src} to {dst}")  # gather-all always works


class _Space:
    """The moves allowed from a layout toward the target, each exact."""

    def __init__(self, shape, itemsize, sizes, target, summable):
        self.shape = shape
        self.itemsize = itemsize
        self.summable = summable  # the dtype can be all-reduced (Broadcast)
        self.sizes = sizes
        self.target = target

    def k(self, axes):
        """Devices along `axes`."""
        out = 1
        for a in axes:
            out *= self.sizes[a]
        return out

    def local(self, dim, axes):
        """Shard size of `dim` split over `axes`."""
        return ceil_div(self.shape[dim], self.k(axes))

    def nbytes(self, layout, padded=None):
        """Local bytes of a tensor in `layout` (dims in `padded` at a given size)."""
        total = self.itemsize
        for d, axes in enumerate(layout.dims):
            total *= (padded or {}).get(d, self.local(d, axes))
        return total

    def moves(self, layout):
        """Every exact step from `layout`."""
        yield from self._partial_moves(layout)
        yield from self._slices(layout)
        yield from self._gathers(layout)
        yield from self._all_to_alls(layout)
        if not layout.partial:
            yield from self._permutes(layout)
            yield from self._exchanges(layout)

    def _nests(self, dim, outer, inner):
        return nests(self.shape[dim], self.k(outer), self.k(inner))

    def _partial_moves(self, layout):
        partial = layout.partial
        if not partial:
            return
        yield AllReduce(partial, self.nbytes(layout), self.k(partial))
        # reduce-scatter the partial axes the target wants next in a dim (all of them, or
        # some, the others reduced later on a smaller tensor)
        for d, (cd, td) in enumerate(zip(layout.dims, self.target.dims)):
            for extra in self._appendable(cd, td, partial):
                if self._nests(d, cd, extra):
                    padded = {d: self.k(extra) * self.local(d, cd + extra)}
                    yield ReduceScatter(d, extra, self.nbytes(layout, padded), self.k(extra))

    @staticmethod
    def _appendable(cd, td, available):
        """Axes sequences (from `available`) to append to a dim holding `cd` whose target
        is `td`: the target's next axes when `cd` is a prefix of `td`, else single axes
        `td` holds elsewhere in its order. The second kind leaves the dim's axes out of
        the target's order, for a permute to reorder later: e.g. a partial sum over y
        reduce-scattered onto a dim split over x, (x, y), then permuted to (y, x) and its
        x all-to-all'd away moves the reduced tensor instead of the unreduced one."""
        if td[:len(cd)] == cd:
            for m in range(len(cd) + 1, len(td) + 1):
                extra = td[len(cd):m]
                if extra[-1] not in available:
                    return
                yield extra
        else:
            for a in td:
                if a in available and a not in cd:
                    yield (a,)

    def _free(self, layout):
        used = set(layout.used_axes)
        return {a for a, s in self.sizes.items() if s > 1 and a not in used}

    def _slices(self, layout):
        free = self._free(layout)
        for d, (cd, td) in enumerate(zip(layout.dims, self.target.dims)):
            if td[:len(cd)] != cd:
                continue
            for m in range(len(cd) + 1, len(td) + 1):
                added = td[len(cd):m]
                if not free.issuperset(added):
                    break
                if self._nests(d, cd, added):
                    yield LocalSlice(d, added)

    def _gathers(self, layout):
        for d, cd in enumerate(layout.dims):
            # a sum of zeros and one element is exact for numbers only, and a pending
            # partial max or min would take the zeros in
            if cd and self.shape[d] == 1 and self.summable and not layout.partial:
                yield Broadcast(d, cd, self.nbytes(layout), self.k(cd))
            for j in range(len(cd)):
                if self._nests(d, cd[:j], cd[j:]):
                    yield AllGather(d, cd[j:], self.nbytes(layout), self.k(cd[j:]))

    def _all_to_alls(self, layout):
        singles = list(self._single_all_to_alls(layout))
        yield from (step for step, _ in singles)
        # moves between distinct dims in one collective over all their axes: it sends
        # (1 - 1/(k1 k2)) of the tensor where one after the other send (1 - 1/k1) + (1 -
        # 1/k2) of it (XLA's all-to-all of several source and target dims)
        for n in range(2, min(len(singles), _MAX_JOINED) + 1):
            for chosen in itertools.combinations(singles, n):
                used = [d for step, _ in chosen for d in (step.concat_dim, step.split_dim)]
                if len(set(used)) < len(used):
                    continue
                padded = {d: size for _, pad in chosen for d, size in pad.items()}
                first = chosen[0][0]
                yield replace(first, bytes_in=self.nbytes(layout, padded),
                              group=math.prod(step.group for step, _ in chosen),
                              also=tuple(step.moves[0] for step, _ in chosen[1:]))

    def _single_all_to_alls(self, layout):
        """(AllToAll of one source and one target dim, its padded split dim {dim: size})."""
        dims = layout.dims
        for d1, cd1 in enumerate(dims):
            for j in range(len(cd1)):
                moved = cd1[j:]
                if not self._nests(d1, cd1[:j], moved):
                    continue
                for d2, c2 in enumerate(dims):
                    if d2 == d1 or not self._wants(d2, c2, moved):
                        continue
                    if not self._nests(d2, c2, moved):
                        continue
                    k = self.k(moved)
                    padded = {d2: k * self.local(d2, c2 + moved)}
                    yield AllToAll(moved, d1, d2, self.nbytes(layout, padded), k), padded

    def _wants(self, d, cd, added):
        """True when the target wants `added` appended to dim `d` (holding `cd`): its
        next axes, or axes it holds out of this order (a permute reorders them later;
        e.g. x all-to-all'd onto a dim split over y, (y, x), then permuted to (x, y) so
        y can be gathered, moves the small shards, not the gathered ones)."""
        td = self.target.dims[d]
        if td[:len(cd) + len(added)] == cd + added:
            return True
        return td[:len(cd)] != cd and set(added) <= set(td)

    def _permutes(self, layout):
        dims, target = layout.dims, self.target.dims
        swaps = {}
        for d, (cd, td) in enumerate(zip(dims, target)):
            if cd == td:
                continue
            # in-dim reorder: the axes the target wants first, in its order (then a gather
            # of the others, instead of gathering the whole dim)
            lead = []
            for a in td:
                if a not in cd:
                    break
                lead.append(a)
            reordered = tuple(lead) + tuple(a for a in cd if a not in lead)
            if reordered != cd and lead:
                yield self._permute(layout, ((d, reordered),))
            if self.k(cd) == self.k(td):
                swaps[d] = td
        candidates = [{d: td} for d, td in swaps.items()]
        if len(swaps) > 1:
            candidates.append(swaps)
        for change in candidates:
            new = [change.get(d, cd) for d, cd in enumerate(dims)]
            flat = [a for axes in new for a in axes]
            if len(flat) == len(set(flat)):
                yield self._permute(layout, tuple(change.items()))

    def _exchanges(self, layout):
        """Permutes that trade two axes of one size between two dims, where one of them
        lands where the target holds it (e.g. data on dim 0 and the major half of
        model on dim 2 traded, so data lands where the target splits dim 2 and the halves
        of model are gathered one by one, the major half last on the larger tensor)."""
        dims, target = layout.dims, self.target.dims
        for d1, cd1 in enumerate(dims):
            for d2 in range(d1 + 1, len(dims)):
                cd2 = dims[d2]
                for i, a in enumerate(cd1):
                    for j, b in enumerate(cd2):
                        if self.sizes[a] != self.sizes[b] or not (
                                target[d2][j:j + 1] == (a,) or target[d1][i:i + 1] == (b,)):
                            continue
                        yield self._permute(layout, ((d1, cd1[:i] + (b,) + cd1[i + 1:]),
                                                     (d2, cd2[:j] + (a,) + cd2[j + 1:])))

    def _permute(self, layout, change):
        axes = {a for _, new in change for a in new} | {a for d, _ in change
                                                        for a in layout.dims[d]}
        return CollectivePermute(tuple(change), self.nbytes(layout), self.k(axes),
                                 tuple(sorted(axes, key=str)))

