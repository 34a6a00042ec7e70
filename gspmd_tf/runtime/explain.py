"""Lowered.explain: why a tensor has its sharding, in words.

Reads only what propagation left behind: the final layouts, the OpRules and the origins
(Propagation.origin: per mesh axis, the user sharding it came from and the ops it went
through). An unsplit dim is explained from the same data: an op's rule keeps it whole
(a REPLICATE factor), or a neighbouring tensor holds an axis on a factor they share in
some op's rule but the axis already splits another dim of this tensor (a conflict: which
user sharding won and by which priority: an earlier layer or sweep, the larger split, or
on a tie the earlier tensor of the op), or nothing reaches it. User shardings are kept
as given.
"""

from __future__ import annotations

import difflib

from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Ref
from gspmd_tf.layout import overlap
from gspmd_tf.propagation.propagate import LAYERS
from gspmd_tf.propagation.rules import REPLICATE
from gspmd_tf.runtime.variables import variable_of_handle

# a chain longer than this shows its first and last few hops
_MAX_HOPS_SHOWN = 6


def explain(lowered, name):
    """The text of Lowered.explain(name) (see there)."""
    graph, propagation = lowered.graph, lowered.propagation
    ref = _resolve(graph, name)
    node = graph.nodes[ref.node]
    layout = propagation.layout(ref)
    shape = list(graph.shape(ref))
    sources = _SeedSources(lowered)
    head = f"{name} ({node.op}, {shape}) is "
    head += "replicated" if layout.is_replicated else f"split {layout.to_spec()!r}"
    lines = [head + "."]
    if ref in lowered._annotated:
        lines.append(f"It is a user sharding: {sources.describe(ref)}; propagation "
                     "keeps user shardings exactly as given.")
    origins = {o.axis: o for o in propagation.origin(ref)}
    lines += _origin_lines(graph, origins, sources)
    if ref not in lowered._annotated:
        quiet = []  # unsplit dims that nothing offered an axis
        for d, axes in enumerate(layout.dims):
            missing = _missing_axes(lowered, ref, d, axes, origins, sources)
            lines += missing
            if not axes and not missing and shape[d] != 1:
                quiet.append(d)
        if propagation.rules[ref.node] is None and node.op != "Placeholder":
            lines.append(f"- {node.op} {node.name!r} has no sharding rule: it runs "
                         "replicated, and its results take splits only from the ops that "
                         "read them.")
        if quiet:
            lines.append(f"- dim{'s' if len(quiet) > 1 else ''} "
                         f"{', '.join(map(str, quiet))}: replicated, no user sharding "
                         f"reaches {'them' if len(quiet) > 1 else 'it'} through the ops "
                         "around this tensor.")
    return "\n".join(lines)


def _origin_lines(graph, origins, sources):
    """A line per propagated axis: its user sharding and the ops it passed; axes of one
    dim that came together (same seed, same ops) share a line."""
    together = {}
    for origin in origins.values():
        if origin.num_hops:
            key = (origin.dim, origin.seed,
                   tuple((h.op, h.direction, h.layer) for h in origin.hops))
            together.setdefault(key, []).append(origin)
    lines = []
    for (dim, seed, _), group in together.items():
        axes = " and ".join(repr(o.axis) for o in group)
        lines.append(f"- {axes} (dim {dim}) come{'s' if len(group) == 1 else ''} from "
                     f"{sources.describe(graph.ref(seed))} {_path(group[0].hops)}.")
    return lines


def _resolve(graph, name):
    """The Ref of tensor `name`, or a ShardingError naming close names."""
    try:
        return graph.ref(name)
    except (KeyError, ValueError):
        pass
    names = [n.name for n in graph.nodes] + list(graph.aliases)
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = (f"; close names: {', '.join(map(repr, close))}" if close else
            "; lowered.report() lists every tensor")
    raise ShardingError(f"explain: no tensor named {name!r} in the traced graph{hint}")


def _path(hops):
    """'forward through MatMul 'h', Relu 'relu' (layer 1: all ops)': consecutive hops in
    one direction and layer grouped; a long chain shows its ends."""
    hops = list(hops)
    skipped = 0
    if len(hops) > _MAX_HOPS_SHOWN:
        skipped = len(hops) - _MAX_HOPS_SHOWN
        hops = hops[:3] + [None] + hops[-3:]
    groups = []  # [direction, layer, [op texts]]
    for hop in hops:
        if hop is None:
            groups.append([None, None, [f"... {skipped} more ops ..."]])
        elif groups and groups[-1][:2] == [hop.direction, hop.layer]:
            groups[-1][2].append(f"{hop.op_type} {hop.op!r}")
        else:
            groups.append([hop.direction, hop.layer, [f"{hop.op_type} {hop.op!r}"]])
    return ", then ".join(
        texts[0] if direction is None else
        f"{direction} through {', '.join(texts)} ({_layer(layer)})"
        for direction, layer, texts in groups)


def _layer(layer):
    """'layer 1: all ops'."""
    return f"layer {LAYERS.index(layer)}: {layer}"


class _SeedSources:
    """Words for the user sharding of a seed tensor: argument, variable, annotation,
    out_shardings entry."""

    def __init__(self, lowered):
        graph = lowered.graph
        self._graph = graph
        self._committed = lowered.committed_args
        self._args = {ref: i for i, ref in enumerate(graph.inputs)}
        self._first_capture = len(graph.inputs) - len(graph.captures)
        self._outputs = {ref: j for j, ref in enumerate(graph.outputs)}

    def describe(self, ref):
        graph = self._graph
        tensor = graph.tensor_name(ref)
        if ref in graph.annotations:
            return f"the annotation on {tensor!r} (gt.mesh_split or an XlaSharding op)"
        i = self._args.get(ref)
        if i is not None and i >= self._first_capture:
            variable = variable_of_handle(graph.captures[i - self._first_capture])
            if variable is not None:
                return (f"variable {variable.name!r} (a captured gt.Variable, spec "
                        f"{variable.spec!r})")
            return f"captured variable {tensor!r}"
        if i is not None:
            given = ("the ShardedTensor passed there" if i in self._committed
                     else f"in_shardings[{i}]")
            return f"argument {i} ({tensor!r}, {given})"
        j = self._outputs.get(ref)
        if j is not None:
            return f"out_shardings[{j}] (output {j}, {tensor!r})"
        return f"the user sharding of {tensor!r}"


def _neighbours(lowered, ref):
    """(node index, rule, slot dims of `ref`, [(other Ref, its slot dims)]) for every op
    with a rule that reads or writes `ref`."""
    graph, rules = lowered.graph, lowered.propagation.rules
    if lowered._consumers is None:
        lowered._consumers = graph.consumers()
    places = [(ref.node, "result", ref.out)]
    places += [(i, "operand", pos) for i, pos in lowered._consumers[ref.node]
               if graph.nodes[i].inputs[pos] == ref]
    for i, kind, position in places:
        rule = rules[i]
        if rule is None:
            continue
        node = graph.nodes[i]
        tensors = [(r, dims) for r, dims in zip(node.inputs, rule.operands) if dims is not None]
        tensors += [(Ref(i, k), dims) for k, dims in enumerate(rule.results)]
        own = (rule.results if kind == "result" else rule.operands)[position]
        if own is None:
            continue
        yield i, rule, own, [(r, dims) for r, dims in tensors if r != ref]


def _missing_axes(lowered, ref, d, axes, origins, sources):
    """Lines on why dim d of `ref` (holding `axes`) is not split further: a REPLICATE
    factor, or axes a neighbour holds on a factor of dim d that dim d lacks."""
    graph, propagation, mesh = lowered.graph, lowered.propagation, lowered.mesh
    lines, seen = [], set(axes)
    for i, rule, own, others in _neighbours(lowered, ref):
        node = graph.nodes[i]
        if not axes and any(rule.factor_kinds[f] == REPLICATE for f in own[d]):
            lines.append(f"- dim {d}: replicated, {node.op} {node.name!r} keeps it whole "
                         f"(a REPLICATE factor in its rule {rule}).")
            continue
        for other, offered in _offers(propagation, own[d], others):
            for axis in offered:
                if any(overlap(axis, held) for held in seen):  # held, or part of one held
                    continue
                seen.add(axis)
                where = (f"{graph.tensor_name(other)!r} holds {axis!r} on the dim "
                         f"{node.op} {node.name!r} maps to this one")
                if axis in origins:
                    lines.append(_conflict(lowered, d, axis, origins[axis], other, offered,
                                           node, mesh, sources, where))
                else:
                    why = _not_carried(axes, offered, own[d], rule, origins, node, mesh)
                    lines.append(f"- dim {d} lacks {axis!r}: {where}, but {why}.")
    return lines


def _offers(propagation, factors, others):
    """(tensor, axes of its dim) for each dim of the `others` (Ref, slot dims) that
    shares one of `factors`."""
    for f in factors:
        for other, dims in others:
            for d2, held in enumerate(dims):
                if f in held:
                    yield other, propagation.layout(other).dims[d2]


def _not_carried(axes, offered, factors, rule, origins, node, mesh):
    """Why a free axis a neighbour offered (`offered`, on a shared factor) did not extend
    a dim that holds `axes` (made of `factors` of `rule` at op `node`)."""
    if tuple(offered[:len(axes)]) != tuple(axes):
        text = f"this dim is split over {tuple(axes)}, which that split does not extend"
        last = origins[axes[0]].hops[-1] if origins[axes[0]].num_hops else None
        if last is not None and last.op == node.name:
            held, other = _ways(axes, mesh), _ways(offered, mesh)
            rule_text = ("the larger split wins" if held != other else
                         "on a tie the earlier tensor of the op wins")
            return (f"{text}: {node.op} {node.name!r} chose {tuple(axes)} ({held} ways, "
                    f"from {last.source!r}) over {tuple(offered)} ({other} ways): "
                    f"{rule_text}")
        return f"{text}, and {tuple(axes)} got there first (propagation only appends axes)"
    if len(factors) > 1:
        return (f"this dim is made of several factors of the op's rule ({rule}) and the "
                "split does not divide them evenly")
    # not reached by the core's rules as they stand; said plainly rather than guessed
    return f"propagation did not carry it across this op (its rule: {rule})"


def _ways(axes, mesh):
    """How many ways mesh axes `axes` (names or SubAxis) split a dim."""
    return mesh.axes_size(axes)


def _conflict(lowered, d, axis, winner, loser_tensor, loser_axes, node, mesh, sources,
              where):
    """Why `axis` went to another dim (`winner`, its Origin) rather than dim d."""
    graph, propagation = lowered.graph, lowered.propagation
    loser = next((o for o in propagation.origin(loser_tensor) if o.axis == axis), None)
    wanted = (f"{sources.describe(graph.ref(loser.seed))} wanted it here"
              if loser is not None else "it was offered here")
    text = (f"- dim {d} lacks {axis!r}: {where} ({wanted}), but {axis!r} already splits "
            f"dim {winner.dim}, from {sources.describe(graph.ref(winner.seed))}; a mesh "
            "axis splits one dim of a tensor only. ")
    last = winner.hops[-1] if winner.num_hops else None
    if last is not None and last.op == node.name:
        won = propagation.layout(graph.ref(last.source)).dims
        won_axes = next(a for a in won if axis in a)
        won_size, lost_size = _ways(won_axes, mesh), _ways(loser_axes, mesh)
        if won_size != lost_size:
            why = (f"the larger split wins ({won_size} ways, {tuple(won_axes)} on "
                   f"{last.source!r}, against {lost_size} ways)")
        else:
            why = (f"both split {won_size} ways, and on a tie the earlier tensor of the op "
                   f"wins ({last.source!r} comes before {graph.tensor_name(loser_tensor)!r} "
                   "among its operands and results), as XLA picks the first of equally "
                   "split operands")
        return text + f"Both reached {node.op} {node.name!r}: {why}."
    if last is None:
        return text + "That split is the tensor's own user sharding."
    return (text + f"{axis!r} got there first, through {last.op_type} {last.op!r} "
            f"({_layer(last.layer)}); propagation only adds axes, so the later offer "
            "found it taken.")
