"""choose(): the auto-sharding stage, between propagate and partition.

    labels, AUTO inputs tied to their weight's (ties.py)
      -> classes (clusters.py) -> candidates per class (strategies.py)
      -> followers (follow.py) -> costs and memory rows (problem.py)
      -> integer program (solve.py) -> AutoPlan

The lowering propagates from the given shardings first (that gives every node its
OpRule), calls choose() for the AUTO entries, adds the chosen layouts to the seeds and
propagates again. The search prices every tensor it has candidates for, and its layouts
for all of them are seeds (as XLA's auto-sharding pass sets every instruction's
sharding): the partitioned program is then the one the costs and memory rows describe.
Constants and tensors computed from static shapes alone (static_nodes) are the exception:
propagation lays them out from their readers, and auto_report() does not list them.
Propagation fills in the tensors of ops without candidates (no rule, control flow).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import tensorflow as tf

from gspmd_tf.autoshard.clusters import cluster, layer_free_name
from gspmd_tf.autoshard.follow import follow
from gspmd_tf.autoshard.plan import AutoPlan, Pricer, decision, step_peak
from gspmd_tf.autoshard.problem import build
from gspmd_tf.autoshard.solve import Infeasible, solve
from gspmd_tf.autoshard.strategies import fixed_strategy, rule_strategies, tensor_strategies
from gspmd_tf.autoshard.ties import tied_inputs
from gspmd_tf.cost_model import CostModel
from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Graph, Ref
from gspmd_tf.mesh import Mesh
from gspmd_tf.registry import is_stateful

# Ops whose results depend only on static shapes and attributes (static_nodes).
_STATIC_SOURCES = frozenset({"Const", "Shape", "ShapeN", "Size", "Rank"})


def choose(graph: Graph, mesh: Mesh, rules: Sequence, seeds: dict,
           auto_inputs: Sequence[int], auto_outputs: Sequence[int],
           memory_limit: Optional[int], resident_bytes: int, program: str) -> AutoPlan:
    """Layouts for the AUTO entries: `auto_inputs` index graph.inputs, `auto_outputs`
    graph.outputs. `rules` holds each node's OpRule (None: no rule), `seeds` the given
    layouts ({Ref: Layout}, fixed), `memory_limit` the per-device bytes the plan must
    fit (None: no limit) beside `resident_bytes` (captured variables' shards);
    `program` names the program in errors. ShardingError when nothing fits."""
    start = time.perf_counter()
    model = CostModel.for_mesh(mesh)
    input_nodes = {r.node for r in graph.inputs}
    auto_refs = {graph.inputs[i] for i in auto_inputs} | {graph.outputs[j]
                                                           for j in auto_outputs}
    factors = {}  # id(rule) -> rule.key(): propagation shares one OpRule per rule key
    labels = [_label(i, node, rules[i], factors, seeds, auto_refs, input_nodes)
              for i, node in enumerate(graph.nodes)]
    # a slot (Adam's m, v) takes its weight's decision: the update then reshards neither
    for slot, weight in tied_inputs(graph, rules, [graph.inputs[i].node
                                                   for i in auto_inputs]).items():
        labels[slot] = labels[weight]
    class_of = cluster(labels)
    strategies = {}
    for i, c in enumerate(class_of):
        if c not in strategies:
            strategies[c] = _candidates(graph, mesh, i, rules[i], seeds, input_nodes)
    strategies = {c: s for c, s in strategies.items() if s}
    leaders = follow(graph, rules, class_of, strategies, seeds)
    problem = build(graph, mesh, model, class_of, strategies, leaders, resident_bytes)
    try:
        solution = solve(problem, memory_limit)
    except Infeasible as e:
        raise ShardingError(
            f"{program}: no sharding of its {len(auto_refs)} AUTO entries fits "
            f"memory_limit={memory_limit} bytes per device; the smallest plan the search "
            f"found needs about {e.smallest_bytes} bytes per device. Raise memory_limit "
            "to at least that, run on a mesh with more devices, or shard more of what "
            "stays fixed (make given in_shardings/variables split over more mesh axes, "
            "or give AUTO to more arguments)") from None
    class_index = {c: k for k, c in enumerate(sorted(strategies))}
    pricer = Pricer(problem, solution.choice)

    def chosen(ref):
        k = class_index.get(class_of[ref.node])
        return None if k is None else problem.classes[k].strategies[solution.choice[k]] \
            .results[ref.out]

    layouts = {}
    derived = static_nodes(graph)
    for k in class_index.values():
        strategy = problem.classes[k].strategies[solution.choice[k]]
        for m in problem.classes[k].members:
            for out, layout in enumerate(strategy.results):
                ref = Ref(m, out)
                if layout is not None and ref not in seeds and m not in derived and \
                        graph.dtype(ref) not in (tf.resource, tf.variant):
                    layouts[ref] = layout
    inputs = {i: chosen(graph.inputs[i]) for i in auto_inputs}
    outputs = {j: chosen(graph.outputs[j]) for j in auto_outputs}
    memo = {}
    decisions = [decision(pricer, graph.tensor_name(ref), entry,
                          class_index.get(class_of[ref.node]), ref.out, memo)
                 for entry, ref in [(f"argument {i}", graph.inputs[i]) for i in auto_inputs]
                 + [(f"output {j}", graph.outputs[j]) for j in auto_outputs]]
    return AutoPlan(layouts, {i: l for i, l in inputs.items() if l is not None},
                    {j: l for j, l in outputs.items() if l is not None}, decisions,
                    solution, problem, len(graph.nodes), memory_limit,
                    time.perf_counter() - start, step_peak(problem, solution.choice))


def static_nodes(graph: Graph) -> set:
    """The nodes whose values follow from constants and static shapes alone: Const,
    Shape, ShapeN, Size, Rank, and stateless ops reading only such nodes. Their layouts
    are left to propagation (from their readers'), not set by the plan: they are not
    data a user could annotate (a Reshape's shape operand, a gradient's constant), and
    seeding them would make auto_report() list them as pins."""
    found = set()
    for i, node in enumerate(graph.nodes):
        if node.op in _STATIC_SOURCES or (
                node.inputs and not node.regions and not is_stateful(node.op)
                and all(ref.node in found for ref in node.inputs)):
            found.add(i)
    return found


def _label(i, node, rule, factors, seeds, auto_refs, input_nodes):
    """What a node must share with another to share its decision (clusters.py)."""
    refs = [Ref(i, k) for k in range(len(node.out_shapes))]
    given = tuple(seeds.get(r) for r in refs)
    auto = tuple(r in auto_refs for r in refs)
    if i in input_nodes:
        what = ("input", tuple(node.out_shapes), tuple(node.out_dtypes))
    elif rule is not None:
        key = factors.get(id(rule))
        if key is None:
            key = factors[id(rule)] = rule.key()
        what = (node.op, key)  # the factors, which the candidates are made of
    else:
        what = (node.op, tuple(node.out_shapes))
    return what, layer_free_name(node.name), given, auto


def _candidates(graph, mesh, i, rule, seeds, input_nodes) -> list:
    """The strategies of node i (empty: it keeps what propagation gives it)."""
    node = graph.nodes[i]
    if i in input_nodes:
        seed = seeds.get(Ref(i, 0))
        if seed is not None:
            return [fixed_strategy(seed)]
        if node.out_dtypes[0] in (tf.resource, tf.variant):
            return []
        return tensor_strategies(node.out_shapes[0], mesh)
    if rule is None or node.regions:
        return []
    given = [(k, seeds[Ref(i, k)]) for k in range(len(node.out_shapes))
             if Ref(i, k) in seeds]
    for merged in (True, False):  # a given layout only the full list may have
        found = [s for s in rule_strategies(rule, mesh, merged)
                 if all(s.results[k] == layout for k, layout in given)]
        if found or not given:
            return found
    return found
