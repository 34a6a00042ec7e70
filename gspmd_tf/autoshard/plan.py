"""AutoPlan: what the search chose, why, and what the alternatives would cost.

Each decision (an AUTO argument or output) lists its chosen PartitionSpec and every
other spec its class could take, each priced as the whole step with only that class
changed (the model's seconds and the estimated per-device peak), so a user can see how
much the choice matters and copy the plan into annotations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gspmd_tf.autoshard.problem import Problem
from gspmd_tf.autoshard.solve import Solution, roots
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import PartitionSpec


@dataclass(frozen=True)
class Option:
    """One layout of a decided tensor: its spec, the step's modelled seconds and the
    estimated per-device peak bytes with it (everything else as chosen)."""

    spec: PartitionSpec
    seconds: float
    peak_bytes: int


@dataclass(frozen=True)
class Decision:
    """One AUTO entry: the tensor's name in the traced graph, which entry it is
    ("argument 2", "output 0"), its chosen Option and the alternatives, cheapest first.
    `layout` is None where the search had no candidates (propagation decided)."""

    tensor: str
    entry: str
    layout: Optional[Layout]
    chosen: Optional[Option]
    alternatives: tuple


class Pricer:
    """The step's seconds and peak under a choice with one decision changed (a deciding
    class and the classes that follow it), computed from the problem's tables: only the
    changed classes' node costs and edges are re-priced."""

    def __init__(self, problem: Problem, choice: tuple):
        self.problem = problem
        self.choice = choice
        self.root = roots(problem)
        self.group, self.touching = {}, {}
        for k, r in enumerate(self.root):
            self.group.setdefault(r, []).append(k)
        for g in problem.edges:
            for r in {self.root[g.producer], self.root[g.consumer]}:
                self.touching.setdefault(r, []).append(g)
        self.seconds = sum(len(cls.members) * float(cls.node_cost[s]) for cls, s in
                           zip(problem.classes, choice)) + sum(
            self._edge(g, choice) for g in problem.edges)
        self.rows = [row.value(choice) for row in problem.memory]

    @staticmethod
    def _edge(g, choice) -> float:
        return g.count * float(g.cost[g.source[choice[g.producer]],
                                      g.target[choice[g.consumer]]])

    def _local(self, r, s) -> float:
        """Seconds of decision r's classes at strategy s and of their edges (the other
        decisions as chosen)."""
        choice = list(self.choice)
        for k in self.group[r]:
            choice[k] = s
        return sum(len(self.problem.classes[k].members) * float(
            self.problem.classes[k].node_cost[s]) for k in self.group[r]) + sum(
            self._edge(g, choice) for g in self.touching.get(r, ()))

    def option(self, c: int, s: int, layout: Layout) -> Option:
        """The Option of class c's decision taking strategy s, c's tensor then in
        `layout`."""
        r = self.root[c]
        old = self.choice[r]
        seconds = self.seconds - self._local(r, old) + self._local(r, s)
        peak = max((value + sum(int(row.coefficients[k][s] - row.coefficients[k][old])
                                for k in self.group[r] if k in row.coefficients)
                    for row, value in zip(self.problem.memory, self.rows)), default=0)
        return Option(layout.to_spec(), seconds, peak)


class AutoPlan:
    """The search's result: `layouts` ({Ref: Layout} of every tensor it priced, given
    ones left out), `input_layouts` ({flat argument index: Layout}),
    `output_layouts` ({flat output index: Layout}), `decisions`, and the figures of the
    search: `num_nodes`, `num_classes`, `num_variables`, `seconds` (the step as modelled),
    `peak_bytes` (its estimated per-device peak), `memory_limit`, `solve_seconds`,
    `search_seconds` and the solver's `status`."""

    def __init__(self, layouts: dict, input_layouts: dict, output_layouts: dict,
                 decisions: list,
                 solution: Solution, problem: Problem, num_nodes: int,
                 memory_limit: Optional[int], search_seconds: float, peak_bytes: int):
        self.layouts = layouts
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts
        self.decisions = decisions
        self.num_nodes = num_nodes
        self.num_classes = len(problem.classes)
        self.num_variables = solution.num_variables
        self.seconds = solution.seconds
        self.status = solution.status
        self.solve_seconds = solution.solve_seconds
        self.search_seconds = search_seconds
        self.memory_limit = memory_limit
        self.peak_bytes = peak_bytes

    def text(self) -> str:
        """The report: the search's figures, then each decision with its alternatives."""
        limit = "none" if self.memory_limit is None else f"{self.memory_limit} bytes"
        lines = [f"auto-sharding: {len(self.decisions)} decisions; {self.num_nodes} ops in "
                 f"{self.num_classes} classes, {self.num_variables} variables; searched in "
                 f"{self.search_seconds:.2f} s (solver {self.solve_seconds:.2f} s: "
                 f"{self.status})",
                 f"modelled step {self.seconds:.6g} s; estimated peak {self.peak_bytes} "
                 f"bytes per device; memory_limit {limit}", "",
                 f"{'tensor':32s} {'entry':12s} {'chosen':28s} {'seconds':>12s} "
                 f"{'peak bytes':>12s}"]
        for d in self.decisions:
            if d.chosen is None:
                lines.append(f"{d.tensor[:32]:32s} {d.entry:12s} (no candidates: "
                             "propagation decides)")
                continue
            lines.append(f"{d.tensor[:32]:32s} {d.entry:12s} {str(d.chosen.spec):28s} "
                         f"{d.chosen.seconds:12.6g} {d.chosen.peak_bytes:12d}")
            for o in d.alternatives:
                over = (" over the limit" if self.memory_limit is not None
                        and o.peak_bytes > self.memory_limit else "")
                lines.append(f"{'':32s} {'':12s}   or {str(o.spec):23s} {o.seconds:12.6g} "
                             f"{o.peak_bytes:12d}{over}")
        return "\n".join(lines)


def decision(pricer: Pricer, tensor: str, entry: str, c: Optional[int], out: int,
             memo: dict) -> Decision:
    """The Decision of output `out` of a node of class `c` (None: no candidates): the
    chosen option and the cheapest of every other layout. `memo` keeps them per (c, out):
    every member of a class has the same."""
    if c is None:
        return Decision(tensor, entry, None, None, ())
    if (c, out) not in memo:
        strategies = pricer.problem.classes[c].strategies
        chosen_layout = strategies[pricer.choice[c]].results[out]
        best = {}
        for s, strategy in enumerate(strategies):
            layout = strategy.results[out]
            if layout == chosen_layout:
                continue
            option = pricer.option(c, s, layout)
            if layout not in best or option.seconds < best[layout].seconds:
                best[layout] = option
        memo[c, out] = (chosen_layout, pricer.option(c, pricer.choice[c], chosen_layout),
                        tuple(sorted(best.values(), key=lambda o: (o.seconds, o.peak_bytes))))
    return Decision(tensor, entry, *memo[c, out])


def step_peak(problem: Problem, choice: tuple) -> int:
    """The fullest memory row under `choice` (bytes per device)."""
    return max((row.value(choice) for row in problem.memory), default=0)

