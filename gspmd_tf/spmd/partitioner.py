"""The partitioner: rewrite an imported graph into one SPMD program.

For every op, in graph order: pick the mesh axes of each factor of its rule (the result's
target layout decides the factors it has, the operands' layouts the reduced ones), reshard
the operands to match, emit the local op through the handler the op registry gives it
(or replay it, where the registry declares that exact), and reshard each result to the
layout propagation chose for it. Ops without a rule run replicated. Control-flow ops
(While, If, Case: nodes with regions) have each region partitioned once into a
sub-program of its own (spmd/control_flow.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import tensorflow as tf

from gspmd_tf.cost_model import CostModel
from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Graph, Ref
from gspmd_tf.layout import Layout, merged_layout
from gspmd_tf.mesh import Mesh
from gspmd_tf.propagation.propagate import Propagation
from gspmd_tf.propagation.rules import REDUCE
from gspmd_tf.registry import op_def
from gspmd_tf.spmd.combine import combine_all_reduces, threshold_bytes
from gspmd_tf.graph.dce import compact, live_nodes
from gspmd_tf.spmd.handlers import replay
from gspmd_tf.spmd.handlers.basic import any_padded, local_shapes
from gspmd_tf.spmd.handlers.slicing import IDENTITIES, picked_targets
from gspmd_tf.spmd.control_flow import partition_control_flow
from gspmd_tf.spmd.factor_axes import choose_factor_axes
from gspmd_tf.spmd.export import export
from gspmd_tf.spmd.program import UNMOVABLE, Local, ProgramBuilder
from gspmd_tf.spmd.provenance import Origin, reshard_reason
from gspmd_tf.spmd.reshard import place
from gspmd_tf.spmd.windowed_einsum import windowed_dot

log = logging.getLogger("gspmd_tf")
_NAMES_SHOWN = 10  # op names a grouped replicated-op warning lists
_LOST_SHOWN = 3  # ops of one type whose gathered splits that warning spells out
PROGRESS_EVERY = 10_000  # ops between two progress lines (log level INFO)


@dataclass
class SpmdProgram:
    """The partitioned program (dead code eliminated, reshards exported to collectives,
    small independent all-reduces combined) with its input/output layouts. `explicit`
    is the same program before the export pass (spmd/export.py): every layout change a
    gt.Reshard node, no all-reduce combined (the annotated global graph for XLA reads
    its reshards, see runtime/annotated.py)."""

    graph: Graph
    input_layouts: list[Layout]
    output_layouts: list[Layout]
    replicated_ops: list[str]
    explicit: Optional[Graph] = None
    # collective node name -> its provenance.Origins (a combined all-reduce: its members')
    origins: dict[str, tuple] = field(default_factory=dict)
    # input / output index -> the mesh (the devices in another order) whose placement of
    # its layout it has at the boundary, where a sharding asked for one (Sharding.placement)
    input_placements: dict[int, Mesh] = field(default_factory=dict)
    output_placements: dict[int, Mesh] = field(default_factory=dict)


class OpContext:
    """What a handler sees: the node, its rule, operands and target result layouts."""

    def __init__(self, partitioner, index, rule, targets):
        self.p = partitioner
        self.index = index
        self.b = partitioner.b
        self.mesh = partitioner.b.mesh
        self.graph = partitioner.graph
        self.node = self.graph.nodes[index]
        self.rule = rule
        self.targets = targets
        self.inputs = [partitioner.values[r] for r in self.node.inputs]
        self.decision = (partitioner.decide(rule, self.inputs, targets, self.node)
                         if rule else None)
        self.factor_axes = self.decision.factor_axes if rule else None

    def reshard(self, local, layout, reason="operand layout"):
        """`local` in `layout` (cached per tensor and layout), needed by this op."""
        tensor = next((r for r, x in zip(self.node.inputs, self.inputs) if x is local), None)
        return self.p.reshard(local, layout, reason,
                              tensor=None if tensor is None else self.graph.tensor_name(tensor))

    def dims_layout(self, dims_factors, partial=()):
        """The layout whose dims are split over the chosen axes of their factors."""
        return merged_layout(Layout(tuple(tuple(a for f in fs for a in self.factor_axes[f])
                                          for fs in dims_factors), partial,
                                    self.rule.reduce_op))

    def split_reduce_axes(self):
        """Axes of the REDUCE factors that are split (the results are partial over them)."""
        return tuple(a for f, kind in enumerate(self.rule.factor_kinds) if kind == REDUCE
                     for a in self.factor_axes[f])

    def operand_layouts(self):
        """The layouts the operands are resharded to: their factors' chosen axes
        (non-data inputs replicated)."""
        decision = self.decision
        if decision.operand_layouts is None:
            decision.operand_layouts = [
                Layout.replicated(len(x.shape)) if dims is None else self.dims_layout(dims)
                for x, dims in zip(self.inputs, self.rule.operands)]
        return decision.operand_layouts

    def operands(self):
        """Operands resharded to the chosen factor axes (non-data inputs replicated)."""
        return [self.reshard(x, layout) for x, layout in zip(self.inputs,
                                                              self.operand_layouts())]

    def result_layouts(self):
        """Layouts of the results as computed (partial over split REDUCE factors)."""
        decision = self.decision
        if decision.result_layouts is None:
            partial = self.split_reduce_axes()
            decision.result_layouts = [self.dims_layout(dims, partial)
                                       for dims in self.rule.results]
        return list(decision.result_layouts)

    def local_shape(self, layout, k=0):
        """Local shape of result k under `layout`."""
        return self.p.local_shape(layout, self.node.out_shapes[k])


class Decision:
    """The partitioner's choice for one op: the mesh axes of every factor of its rule, and
    (filled on first use) the layouts its operands are resharded to and its results come
    out in. It depends only on the op's rule, its operands' layouts, shapes and dtypes,
    and its results' target layouts, shapes and dtypes (see Partitioner.decide), so ops
    that agree on those (the same op in every repeated layer) share one Decision."""

    __slots__ = ("factor_axes", "operand_layouts", "result_layouts", "replay_shapes")

    def __init__(self, factor_axes):
        self.factor_axes = factor_axes
        self.operand_layouts = None
        self.result_layouts = None
        # emit function -> the local result shapes of an op it replayed with no operand
        # padded (Partitioner._replay_memoised); like the rest, a function of the key
        self.replay_shapes = {}


class Partitioner:
    """Builds the SPMD program of an imported graph from its propagated layouts."""

    def __init__(self, graph: Graph, mesh: Mesh, propagation: Propagation,
                 parent: Optional[Partitioner] = None, prefix: str = "",
                 windowed_einsum: Optional[int] = None,
                 combine_bytes: Optional[Callable[[bool], int]] = None,
                 cost_model: Optional[CostModel] = None, annotated: frozenset = frozenset()):
        """`annotated`: the Refs with a user sharding (for provenance); `windowed_einsum`:
        the byte threshold of windowed dots (see
        spmd/windowed_einsum.py), None for none; `combine_bytes(in_region)`: the
        all-reduce combiner's threshold the backend asks for (Backend.
        all_reduce_combine_bytes), None for the cost model's; `cost_model` prices
        reshards and sets the combiner's default (CostModel.for_mesh(mesh) by default);
        a region's partitioner takes all three from its parent."""
        self.graph = graph
        self.propagation = propagation
        self.b = ProgramBuilder(mesh, prefix, parent.b.cost_model if parent else cost_model)
        self.b.origins = parent.b.origins if parent else self.b.origins
        self.current_op = None  # the index of the graph op at hand (for _reason)
        self.in_region, self.annotated = parent is not None, annotated
        self.values = {}
        self._consumers = None  # graph.consumers(), made when a picking slice asks
        self._resharded = {}  # (Local, Layout, needing op) -> Local (a gt.Reshard's)
        self._made = {}  # (Local, Layout) -> the first Local made of it (or remembered)
        self._remembered = set()  # program nodes of layouts handlers made themselves
        self._needed_by = ""  # the op being partitioned (gt.Reshard's needed_by)
        # a region's partitioner shares its parent's memos and list of replicated ops
        self._decisions = parent._decisions if parent else {}  # rule key -> {key -> Decision}
        self._rule_decisions = parent._rule_decisions if parent else {}  # id(rule) -> table
        self._local_shapes = parent._local_shapes if parent else {}
        self._padded = parent._padded if parent else {}
        self.replicated_ops = parent.replicated_ops if parent else []
        self._placements = ({}, {})  # run()'s: a region's boundary is the program's mesh
        self._replicated_kinds = parent._replicated_kinds if parent else {}
        # replicated op name -> (its partitioner, [(operand Ref, Layout) arrived split])
        self._lost_splits = parent._lost_splits if parent else {}
        self.windowed_einsum = parent.windowed_einsum if parent else windowed_einsum
        self.combine_bytes = parent.combine_bytes if parent else combine_bytes

    def region_partitioner(self, region: Graph, propagation, prefix: str) -> Partitioner:
        """A partitioner of one region (a control-flow body) of this graph, sharing this
        one's memos and settings; spmd/control_flow.py partitions each region with one."""
        return Partitioner(region, self.b.mesh, propagation, parent=self, prefix=prefix)

    def decide(self, rule, inputs, targets, node):
        """The Decision for an op with `rule`, operands `inputs` (Locals) and result
        `targets`, memoised on everything choose_factor_axes reads. A rule is keyed by
        its value (OpRule.key, computed once per rule object: propagation shares one
        object between ops with equal rules)."""
        decisions = self._rule_decisions.get(id(rule))
        if decisions is None:
            # the propagation holds every rule while we run, so ids are not reused;
            # rules with equal keys share one table
            decisions = self._rule_decisions[id(rule)] = self._decisions.setdefault(
                rule.key(), {})
        # x[1:] of a Local: (layout, shape, dtype)
        key = (tuple([x[1:] for x in inputs]), tuple(targets),
               tuple(node.out_shapes), tuple(node.out_dtypes))
        decision = decisions.get(key)
        if decision is None:
            decision = decisions[key] = Decision(
                choose_factor_axes(self.b.mesh, self.b.cost_model, rule, inputs, targets,
                                   node))
        return decision

    def local_shape(self, layout, shape):
        """Local shape of a tensor of global `shape` under `layout` (cached: repeated
        layers ask for the same few)."""
        key = (layout.dims, shape)
        local = self._local_shapes.get(key)
        if local is None:
            local = self._local_shapes[key] = layout.local_shape(self.b.mesh, shape)
        return local

    def padded(self, local):
        """Whether Local `local` has a split dim its axes do not divide, i.e. its shards
        are padded (cached: repeated layers ask about the same few)."""
        dims, shape = local.layout.dims, local.shape
        padded = self._padded.get((dims, shape))
        if padded is None:
            mesh = self.b.mesh
            padded = self._padded[dims, shape] = any(
                axes and n % mesh.axes_size(axes) for n, axes in zip(shape, dims))
        return padded

    def reshard(self, local, layout, reason="operand layout", needed_by=None, tensor=None):
        """`local` in `layout`: a gt.Reshard node (the export pass lowers it to
        collectives), one per tensor, layout and op needing it (`needed_by`, the op being
        partitioned by default), cached (keyed by all of the Local: equal constants are
        one node, so one ref can hold tensors of other global shapes or layouts). Its
        `reason` is "contraction" when `local` is a partial result; `tensor` names the
        traced tensor moved, when known. A layout a handler made itself
        (remember_reshard) is taken as it is."""
        # most requests: no lookup, no hashing of layouts (propagation and decisions
        # share Layout objects, so identity settles most)
        if local.layout is layout or local.layout == layout:
            return local
        if local.dtype == tf.variant:
            raise ShardingError(
                f"a TensorList whose elements are split as {local.layout.to_spec()!r} would "
                f"need them resharded to {layout.to_spec()!r}, which gspmd-tf cannot do "
                "inside a list; split the tensors written into it the same way everywhere "
                "(or keep them whole)")
        if local.dtype == tf.resource:
            # a handle's layout is its variable's: the shards stay where they are
            raise ShardingError(
                f"op {self._needed_by!r} ({self.graph.nodes[self.current_op].op}) would "
                f"need the variable {tensor or 'of its operand'!r}, which is split as "
                f"{local.layout.to_spec()!r}, split as {layout.to_spec()!r} (as the "
                "variables and tensors it updates together with it), and gspmd-tf cannot "
                "move a variable's shards; give the variables an op updates together (a "
                "variable and its optimizer slots) the same spec")
        made = self._made.get((local, layout))
        if made is not None and made.ref.node in self._remembered:
            return made
        needed_by = needed_by or self._needed_by
        key = (local, layout, needed_by)
        if key not in self._resharded:
            ref = self.b.reshard(local, layout, needed_by,
                                 self._reason(local, layout, reason), tensor)
            self._resharded[key] = Local(ref, layout, local.shape, local.dtype)
            self._made.setdefault((local, layout), self._resharded[key])
        return self._resharded[key]

    def _reason(self, local, layout, asked):
        """The reason code (provenance.REASONS) a gt.Reshard of `local` to `layout` asked
        for as `asked` by the op at hand records: refined by provenance.reshard_reason. An
        output moved to its out_shardings is an annotation; inside a region it is the
        loop's own layout (a result layout)."""
        if asked == "annotation":
            return ("annotation" if not self.in_region
                    else reshard_reason("result layout", False, local.layout, layout,
                                        local.shape, self.b.mesh))
        index, graph = self.current_op, self.graph
        annotated = index is not None and any(
            Ref(index, k) in graph.annotations or Ref(index, k) in self.annotated
            for k in range(len(graph.nodes[index].out_shapes)))
        return reshard_reason(asked, annotated, local.layout, layout, local.shape,
                              self.b.mesh)

    def resharded(self, local, layout):
        """`local` in `layout` if a reshard made it already (see reshard), else None."""
        return self._made.get((local, layout))

    def remember_reshard(self, local, layout, result):
        """Records `result` (a Local) as `local` in `layout`, made by a handler itself
        (a windowed dot's loop gathers its operand on the way), for later reshards."""
        if (local, layout) not in self._made:
            self._made[local, layout] = result
            self._remembered.add(result.ref.node)

    def run(self, output_layouts: Sequence[Layout], input_placements: dict[int, Mesh],
            output_placements: dict[int, Mesh]) -> SpmdProgram:
        """Partition every node; outputs resharded to `output_layouts`; then the export
        pass and the all-reduce combiner. The inputs and outputs `*_placements` name
        enter / leave placed as their layouts are on that mesh (one collective-permute
        each to or from the program's placement)."""
        self._placements = input_placements, output_placements
        outputs = self._partition(output_layouts)
        self._warn_replicated()
        graph = self.graph
        explicit = self._live_program()
        exported = export(explicit, self.b.mesh, self.b.cost_model, self.b.origins)
        return SpmdProgram(self._combined(exported, in_region=False),
                           [self.values[r].layout for r in graph.inputs],
                           [o.layout for o in outputs], self.replicated_ops,
                           explicit, self.b.origins, input_placements, output_placements)

    def partition_region(self, input_layouts: Sequence[Layout],
                         output_layouts: Sequence[Layout]) -> tuple[Graph, list[Layout]]:
        """The explicit-reshard program (a Graph) of a region and its results' layouts:
        its parameters come in `input_layouts` (gt.Input nodes, in order), its results
        leave in `output_layouts` (a None entry: in the layout the result has)."""
        outputs = self._partition(output_layouts, input_layouts)
        return self._live_program(), [local.layout for local in outputs]

    def _live_program(self):
        """The program built, its dead nodes dropped (dead gt.Reshards among them)."""
        return compact(self.b.graph, live_nodes(self.b.graph))

    def _combined(self, program, in_region):
        """`program` (exported) with its all-reduces and its bodies' combined at the
        threshold the backend asks for, else the cost model's (GSPMD_TF_ALL_REDUCE_
        COMBINE_BYTES, when set, wins: combine.threshold_bytes)."""
        for node in program.nodes:
            if node.regions:
                node.regions = [self._combined(region, True) for region in node.regions]
        asked = self.combine_bytes(in_region) if self.combine_bytes else None
        threshold = threshold_bytes(self.b.cost_model.combine_threshold_bytes()
                                    if asked is None else asked)
        return combine_all_reduces(program, threshold, origins=self.b.origins)

    def _partition(self, output_layouts, input_layouts=None):
        """Partition every node; returns the outputs (Locals) in `output_layouts`.
        Inputs come in their propagated layouts, or in `input_layouts` (then resharded
        to the propagated ones)."""
        graph, b = self.graph, self.b
        input_index = {ref.node: i for i, ref in enumerate(graph.inputs)}
        for index, node in enumerate(graph.nodes):
            if index and index % PROGRESS_EVERY == 0:
                log.info("gspmd_tf: partitioned %d of %d ops", index, len(graph.nodes))
            targets = self.propagation.layouts[index]
            self._needed_by, self.current_op = node.name, index
            rule = self.propagation.rules[index]
            if rule is not None and getattr(rule.params, "picks", ()):
                targets = picked_targets(self, index, targets)
            if index in input_index:
                i = input_index[index]
                shape, dtype = node.out_shapes[0], node.out_dtypes[0]
                layout = targets[0] if input_layouts is None else input_layouts[i]
                placed = self._placements[0].get(i)
                ref = b.input(i, layout.local_shape(b.mesh, shape), dtype,
                              layout if placed is None else None,
                              node.params.get("var_dtype"))
                if placed is not None:
                    ref = self._placed(ref, layout, placed, b.mesh, node.name, node.name)
                local = Local(ref, layout, shape, dtype)
                self.values[graph.inputs[i]] = (local if dtype in UNMOVABLE
                                                else self.reshard(local, targets[0]))
                continue
            if node.op in IDENTITIES and self.values[node.inputs[0]].layout == targets[0]:
                # its operand is in its layout already: kept so even where that splits a
                # size-1 dim (a picked element the user asked to keep split), which no
                # rule expresses
                x = self.values[node.inputs[0]]
                ref = b.op("Identity", [x.ref], b.shape_of(x.ref), x.dtype, name=node.name,
                           T=x.dtype)
                self.values[Ref(index, 0)] = Local(ref, x.layout, x.shape, x.dtype)
                continue
            if node.op == "Const" and rule is not None and targets[0].is_replicated:
                # the common constant: whole on every device, as whole_then_sliced
                # emits it, without a decision to make
                ref = b.replay(node, [], node.out_shapes, node.out_dtypes)[0]
                self.values[Ref(index, 0)] = Local(ref, targets[0], node.out_shapes[0],
                                                   node.out_dtypes[0])
                continue
            entry = op_def(node.op)
            emit = replay if entry.replay else entry.emit
            # a collective a handler emits itself is the op's own algorithm
            b.origin = Origin(node.name, "op algorithm")
            results = (self._replay_memoised(index, node, rule, targets, emit)
                       if rule is not None and not node.regions and self.windowed_einsum is None
                       and (entry.replay or hasattr(emit, "replays")) else None)
            if results is None:
                ctx = OpContext(self, index, rule, targets)
                if node.regions:
                    results = partition_control_flow(self, index, ctx.inputs, targets)
                elif rule is None:
                    results = self._replicated(ctx)
                else:
                    results = self._by_rule(ctx, emit)
            b.origin = None
            for k, (local, target) in enumerate(zip(results, targets)):
                # a variable handle (e.g. one a loop hands through) points to this
                # device's shard whatever layout propagation gave it, and a TensorList
                # holds its shards: never resharded
                self.values[Ref(index, k)] = (
                    local if local.layout is target or local.dtype in UNMOVABLE
                    else self.reshard(local, target, "result layout",
                                      tensor=graph.tensor_name(Ref(index, k))))
        outputs = []
        for j, (ref, layout) in enumerate(zip(graph.outputs, output_layouts)):
            self.current_op = ref.node
            local = self.values[ref]
            local = local if layout is None else self.reshard(
                local, layout, "annotation", graph.nodes[ref.node].name,
                graph.tensor_name(ref))
            outputs.append(local)
            placed = self._placements[1].get(j)
            b.graph.outputs.append(local.ref if placed is None else self._placed(
                local.ref, local.layout, b.mesh, placed, graph.nodes[ref.node].name,
                graph.tensor_name(ref)))
        return outputs

    def consumers(self, index):
        """(consumer node index, input position) of every input node `index` feeds."""
        if self._consumers is None:
            self._consumers = self.graph.consumers()
        return self._consumers[index]

    def _placed(self, ref, layout, src_mesh, dst_mesh, op, tensor):
        """`ref` in `layout` moved from its placement on `src_mesh` to that on `dst_mesh`
        (the program's mesh or its devices in the order a user's sharding names)."""
        self.b.origin = Origin(op, "annotation", tensor, layout, layout)
        ref = place(self.b, ref, self.b.mesh, layout, src_mesh, dst_mesh)
        self.b.origin = None
        return ref

    def _warn_replicated(self):
        """One warning per op type that ran replicated with operands that arrived split,
        with the count and the names (an RNN's hundreds of cells give one line, not
        hundreds), and for the first few, which user shardings those splits came from
        (the annotation, argument or variable whose split the op drops). An op whose
        operands all arrived replicated lost nothing by lacking a rule: not warned."""
        by_type = {}
        for name in self.replicated_ops:
            if name in self._lost_splits:
                by_type.setdefault(self._replicated_kinds[name], []).append(name)
        for op, names in by_type.items():
            shown = ", ".join(names[:_NAMES_SHOWN]) + (
                f", ... ({len(names) - _NAMES_SHOWN} more)" if len(names) > _NAMES_SHOWN else "")
            lost = self._lost_text(names)
            if len(names) == 1:
                log.warning("gspmd_tf: op %s (%s) has no partitioning rule; it runs replicated "
                            "(inputs gathered)%s", shown, op, lost)
            else:
                log.warning("gspmd_tf: %d ops (%s) have no partitioning rule; they run "
                            "replicated (inputs gathered): %s%s", len(names), op, shown, lost)

    def _lost_text(self, names):
        """'; splits lost: 'op' gathers 'x' (split P('data', None): 'data' from the
        annotation on 'h')' for the first _LOST_SHOWN of the ops `names` that gathered
        split operands ('' when none did). Origins are traced only for those."""
        gathering = [name for name in names if name in self._lost_splits]
        if not gathering:
            return ""
        parts = []
        for name in gathering[:_LOST_SHOWN]:
            partitioner, splits = self._lost_splits[name]
            parts.append(f"{name!r} gathers " + ", ".join(
                partitioner._split_source(ref, layout) for ref, layout in splits))
        more = len(gathering) - _LOST_SHOWN
        return "; splits lost: " + "; ".join(parts) + (
            f"; ... ({more} more of these ops gather split operands)" if more > 0 else "")

    def _split_source(self, ref, layout):
        """"'x' (split P('data', None): 'data' from the annotation on 'h')": operand
        `ref`, its layout, and the user sharding each of its mesh axes came from."""
        by_seed = {}
        for origin in self.propagation.origin(ref):
            by_seed.setdefault((origin.seed_kind, origin.seed), []).append(origin.axis)
        sources = ", ".join(
            f"{' and '.join(map(repr, axes))} from "
            + (f"the annotation on {seed!r}" if kind == "annotation" else f"{kind} {seed!r}")
            for (kind, seed), axes in by_seed.items())
        return (f"{self.graph.tensor_name(ref)!r} (split {layout.to_spec()!r}"
                + (f": {sources})" if sources else ")"))

    def _by_rule(self, ctx, emit):
        # a handler may partition the op from its operands' own layouts (where the
        # factors' reshards would move more): emit.without_reshard(ctx) -> Locals or None
        direct = getattr(emit, "without_reshard", None)
        results = direct(ctx) if direct else None
        if results is not None:
            return results
        layouts = ctx.result_layouts()
        windowed = (None if self.windowed_einsum is None
                    else windowed_dot(ctx, self.windowed_einsum))
        operands = ctx.operands() if windowed is None else None
        refs = emit(ctx, operands, layouts) if windowed is None else windowed
        node = ctx.node
        decision = ctx.decision
        if (windowed is None and emit not in decision.replay_shapes
                and not any_padded(ctx, operands)
                and (emit is replay or (hasattr(emit, "replays")
                                        and emit.replays(ctx, operands)))):
            decision.replay_shapes[emit] = local_shapes(ctx, layouts)
        # a handler that combines partial results itself returns Locals
        return [ref if isinstance(ref, Local) else Local(ref, layout, shape, dtype)
                for ref, layout, shape, dtype
                in zip(refs, layouts, node.out_shapes, node.out_dtypes)]

    def _replay_memoised(self, index, node, rule, targets, emit):
        """An op whose handler `emit` replays it (registry entry `replay`, or a handler
        whose `emit.replays(ctx, operands)` says so for this Decision) emitted from its
        Decision alone, as _by_rule would emit it, without an OpContext or the handler:
        once `emit` replayed an op with that Decision and no operand padded, the
        operands' layouts and the local result shapes are known. None while they are not."""
        inputs = [self.values[r] for r in node.inputs]
        decision = self.decide(rule, inputs, targets, node)
        shapes = decision.replay_shapes.get(emit)
        if shapes is None:
            return None
        operand_layouts = decision.operand_layouts
        refs = self.b.replay(node, [self.reshard(x, layout,
                                                 tensor=self.graph.tensor_name(r)).ref
                                    for x, layout, r in zip(inputs, operand_layouts,
                                                            node.inputs)],
                             shapes, node.out_dtypes)
        return [Local(ref, layout, shape, dtype) for ref, layout, shape, dtype
                in zip(refs, decision.result_layouts, node.out_shapes, node.out_dtypes)]

    def _replicated(self, ctx):
        """No rule: gather the inputs, run the op whole on every device."""
        node = ctx.node
        if not op_def(node.op).silent_replicated:
            # warned once per op type when the program is done (_warn_replicated)
            self.replicated_ops.append(node.name)
            self._replicated_kinds[node.name] = node.op
            split = [(ref, x.layout) for ref, x in zip(node.inputs, ctx.inputs)
                     if not x.layout.is_replicated]
            if split:
                self._lost_splits[node.name] = (self, split)
        for ref, x in zip(node.inputs, ctx.inputs):
            if x.dtype == tf.resource and not x.layout.is_replicated:
                raise ShardingError(
                    f"op {node.name!r} ({node.op}) uses the sharded variable "
                    f"{self.graph.tensor_name(ref)!r} but has no partitioning rule; make that "
                    "variable replicated (spec P()) or add a rule for the op")
            if x.dtype == tf.variant and not x.layout.is_replicated:
                raise ShardingError(
                    f"op {node.name!r} ({node.op}) reads the TensorList "
                    f"{self.graph.tensor_name(ref)!r}, whose elements are split, but has no "
                    "partitioning rule; keep the tensors written into that list whole, or "
                    "add a rule for the op")
        inputs = [ctx.reshard(x, Layout.replicated(len(x.shape)), "no rule")
                  for x in ctx.inputs]
        refs = self.b.replay(node, [x.ref for x in inputs], node.out_shapes, node.out_dtypes)
        return [Local(ref, Layout.replicated(len(shape)), shape, dtype)
                for ref, shape, dtype in zip(refs, node.out_shapes, node.out_dtypes)]


def partition(graph: Graph, mesh: Mesh, propagation: Propagation,
              output_layouts: Sequence[Layout], windowed_einsum: Optional[int] = None,
              combine_bytes: Optional[Callable[[bool], int]] = None,
              cost_model: Optional[CostModel] = None,
              annotated: frozenset = frozenset(),
              input_placements: Optional[dict[int, Mesh]] = None,
              output_placements: Optional[dict[int, Mesh]] = None) -> SpmdProgram:
    """The SPMD program of `graph` (see Partitioner; `windowed_einsum`: a byte
    threshold, or None; `combine_bytes`: the backend's all_reduce_combine_bytes, or
    None; `cost_model`: the backend's CostModel, or None for CostModel.for_mesh;
    `annotated`: the Refs with a user sharding; `input_placements` /
    `output_placements`: {index: mesh} of the inputs / outputs placed as on another
    order of the mesh's devices, Sharding.placement)."""
    return Partitioner(graph, mesh, propagation, windowed_einsum=windowed_einsum,
                       combine_bytes=combine_bytes, cost_model=cost_model,
                       annotated=annotated).run(output_layouts, input_placements or {},
                                                output_placements or {})
