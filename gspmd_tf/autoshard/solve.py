"""The integer program of the search, solved by scipy.optimize.milp (HiGHS).

Variables, as in Alpa's intra-operator pass and XLA's auto-sharding ILP:
  x[c, s]   binary: class c takes strategy s (one per class)
  e[g, a, b] >= 0: edge group g runs from producer layout a to consumer layout b; its
            row sums equal the producer's x summed per layout a, its column sums the
            consumer's per layout b, so with binary x exactly one e is 1. Edges are
            priced per pair of distinct layouts, not of strategies: fewer variables.
A class that follows another (follow.py) has no x of its own: it reads its leader's.
An edge group whose producer makes one layout, or whose consumer needs one, or between
classes of one decision, is linear in x and needs no e. Memory rows bound the per-device
bytes at their points by the limit. Minimise the node and edge seconds.

How it is solved (all by HiGHS): first without the memory rows, which are added only if
that plan does not fit (its optimum is then the limited one's); per program the linear
relaxation, kept when integral; else the best plan among the strategies the relaxation
uses, kept when the relaxation's bound proves it within SUPPORT_GAP of the optimum (the
status says how close); else branch and bound on the whole program (RELATIVE_GAP).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from gspmd_tf.autoshard.problem import Problem
from gspmd_tf.errors import ShardingError

# Objective in microseconds and memory rows in MiB keep HiGHS's tolerances (1e-6 to
# 1e-9 absolute) far below the differences that matter.
_SECONDS_SCALE = 1e6
_BYTES_SCALE = 2.0 ** -20
TIME_LIMIT_SECONDS = 60.0
# Stop within 1% of the optimum: the model's seconds are not more exact than that, and
# proving the last 1% took most of the solver's time on the Transformer benchmark.
RELATIVE_GAP = 1e-2
# When the relaxation is fractional, the best plan among the strategies it uses is
# taken if the relaxation's bound proves it this close to the optimum: on ResNet50
# (7,146 ops, the relaxation half-and-half in 300 of 395 decisions) that plan is found
# in seconds and proven within 2.2%, where the whole MIP took 117 s to reach 0.65%
# (loaded machine) and stopped at its time limit with a load-dependent plan. It is
# solved nearly exactly (SUPPORT_MIP_GAP), so the plan does not depend on timing.
SUPPORT_GAP = 3e-2
SUPPORT_MIP_GAP = 1e-4
# A relaxed solution within this of 0 or 1 is integral.
_INTEGRAL = 1e-6


@dataclass(frozen=True)
class Solution:
    """The strategy index chosen per class, the objective (seconds of the step as the
    model prices it), the solver's status text, the number of variables of the program
    and the seconds it took (building included)."""

    choice: tuple
    seconds: float
    status: str
    num_variables: int
    solve_seconds: float


class Infeasible(Exception):
    """No choice fits the limit; `smallest_bytes` is the least per-device memory of any
    choice (the search's own estimate)."""

    def __init__(self, smallest_bytes: int):
        super().__init__(smallest_bytes)
        self.smallest_bytes = smallest_bytes


class _Builder:
    """Columns (variables) and rows (constraints) of a sparse program."""

    def __init__(self):
        self.cost, self.integral, self.upper = [], [], []
        self.rows, self.cols, self.vals = [], [], []
        self.lower_bounds, self.upper_bounds = [], []

    def variables(self, costs, integral: bool, upper=1.0) -> int:
        """Add one variable per cost; returns the first's index."""
        first = len(self.cost)
        self.cost.extend(costs)
        self.integral.extend([int(integral)] * len(costs))
        self.upper.extend([upper] * len(costs))
        return first

    def row(self, columns, values, low, high):
        """Add the constraint low <= sum(values * x[columns]) <= high."""
        r = len(self.lower_bounds)
        self.rows.extend([r] * len(columns))
        self.cols.extend(columns)
        self.vals.extend(values)
        self.lower_bounds.append(low)
        self.upper_bounds.append(high)

    def _matrix(self):
        return sparse.csr_array((self.vals, (self.rows, self.cols)),
                                shape=(len(self.lower_bounds), len(self.cost)))

    def relax(self, time_limit: float):
        """The linear relaxation's optimum (a scipy OptimizeResult: x, fun, status)."""
        matrix = self._matrix()
        upper = np.asarray(self.upper)
        low, high = np.asarray(self.lower_bounds), np.asarray(self.upper_bounds)
        equal = low == high
        bounded = ~equal & np.isfinite(high)
        return linprog(np.asarray(self.cost),
                       A_ub=matrix[bounded] if bounded.any() else None,
                       b_ub=high[bounded] if bounded.any() else None,
                       A_eq=matrix[equal], b_eq=high[equal],
                       bounds=np.stack([np.zeros_like(upper), upper], axis=1),
                       method="highs", options={"time_limit": time_limit})

    def integral_at(self, x) -> bool:
        """Whether the integer variables of `x` are all integral."""
        values = x[np.asarray(self.integral, bool)]
        return bool(np.all(np.abs(values - np.round(values)) <= _INTEGRAL))

    def mip(self, time_limit: float, gap: float, allowed=None):
        """HiGHS's branch and bound to relative `gap`; `allowed` (a bool per variable,
        None: all) keeps the integer variables outside it at 0."""
        upper = np.asarray(self.upper)
        if allowed is not None:
            upper = np.where(np.asarray(self.integral, bool) & ~allowed, 0.0, upper)
        integral = np.asarray(self.integral, int)
        return milp(np.asarray(self.cost), integrality=integral, bounds=Bounds(0.0, upper),
                    constraints=LinearConstraint(self._matrix(), self.lower_bounds,
                                                 self.upper_bounds),
                    options={"time_limit": time_limit, "mip_rel_gap": gap})

    def solve(self, time_limit: float):
        """The optimum or a plan proven near it (a scipy OptimizeResult: x, fun, status,
        message). The linear relaxation first: when its optimum is integral it is the
        integer optimum, found in a third of the MIP's time (no branching set-up). Else
        the best plan among the strategies the relaxation uses (a small MIP: HiGHS's
        RENS neighbourhood) is taken when the relaxation's bound proves it within
        SUPPORT_GAP of the optimum; else HiGHS's branch and bound on the whole program."""
        relaxed = self.relax(time_limit)
        if relaxed.status == 2:  # infeasible relaxed: infeasible
            return relaxed
        if relaxed.status != 0:
            return self.mip(time_limit, RELATIVE_GAP)
        if self.integral_at(relaxed.x):
            relaxed.message = "optimal (its linear relaxation is integral)"
            return relaxed
        support = self.mip(time_limit, SUPPORT_MIP_GAP, allowed=relaxed.x > _INTEGRAL)
        if support.x is not None:
            gap = (support.fun - relaxed.fun) / max(abs(support.fun), 1e-12)
            if gap <= SUPPORT_GAP:
                support.message = (f"within {gap:.2%} of the optimum (the best plan of the "
                                   "strategies the linear relaxation uses; its bound)")
                return support
        return self.mip(time_limit, RELATIVE_GAP)


def roots(problem: Problem) -> list:
    """The class whose variables each class reads: its leader, or itself."""
    return [k if cls.leader < 0 else cls.leader for k, cls in enumerate(problem.classes)]


def _choices(problem: Problem, builder: _Builder, costs) -> list:
    """One binary per strategy of each deciding class (`costs[k]` their objective, only
    read for those), summing to one per class; returns each class's first column (its
    leader's for a follower)."""
    first = [0] * len(problem.classes)
    root = roots(problem)
    for k, cls in enumerate(problem.classes):
        if root[k] == k:
            first[k] = builder.variables(costs[k], integral=True)
            count = len(cls.strategies)
            builder.row(range(first[k], first[k] + count), [1.0] * count, 1.0, 1.0)
    for k in range(len(problem.classes)):
        first[k] = first[root[k]]
    return first


def solve(problem: Problem, memory_limit: Optional[int],
          time_limit: float = TIME_LIMIT_SECONDS) -> Solution:
    """The cheapest choice whose memory rows all fit `memory_limit` (None: no limit);
    Infeasible when none fits."""
    start_time = time.perf_counter()
    builder = _Builder()
    root = roots(problem)
    linear = [np.zeros(len(cls.strategies)) for cls in problem.classes]
    for k, cls in enumerate(problem.classes):
        linear[root[k]] += cls.node_cost * len(cls.members)
    pairs = []
    for g in problem.edges:
        producer, consumer = root[g.producer], root[g.consumer]
        if producer == consumer:
            linear[producer] += g.count * g.cost[g.source, g.target]
        elif g.cost.shape[0] == 1:
            linear[consumer] += g.count * g.cost[0, g.target]
        elif g.cost.shape[1] == 1:
            linear[producer] += g.count * g.cost[g.source, 0]
        else:
            pairs.append(g)
    first = _choices(problem, builder, [c * _SECONDS_SCALE for c in linear])
    for g in pairs:
        sources, targets = g.cost.shape
        e = builder.variables((g.count * _SECONDS_SCALE * g.cost).ravel(), integral=False)
        for a in range(sources):
            strategies = np.flatnonzero(g.source == a) + first[g.producer]
            builder.row([e + a * targets + b for b in range(targets)] + list(strategies),
                        [1.0] * targets + [-1.0] * len(strategies), 0.0, 0.0)
        for b in range(targets):
            strategies = np.flatnonzero(g.target == b) + first[g.consumer]
            builder.row([e + a * targets + b for a in range(sources)] + list(strategies),
                        [1.0] * sources + [-1.0] * len(strategies), 0.0, 0.0)
    # Memory rows only when the plan without them does not fit: then its optimum is the
    # limited one's. On ResNet50 (206 MiB limit, plan 52 MiB) the rows tripled the
    # relaxation's time; where the limit binds (the Transformer) it costs one more solve.
    result = builder.solve(time_limit)
    if memory_limit is not None and result.x is not None and max(
            (row.value(_choice(problem, first, result.x)) for row in problem.memory),
            default=0) > memory_limit:
        for row in problem.memory:
            columns, values = _row_terms(row, first)
            builder.row(columns, values, -np.inf, (memory_limit - row.constant) * _BYTES_SCALE)
        result = builder.solve(time_limit)
    if result.status == 2:
        raise Infeasible(smallest_memory(problem, time_limit))
    if result.x is None:
        raise ShardingError(
            f"the auto-sharding search found no plan within {time_limit:g} s "
            f"({result.message}): give fixed in_shardings to some of the gt.AUTO entries "
            "to shrink the search")
    choice = _choice(problem, first, result.x)
    return Solution(choice, float(result.fun) / _SECONDS_SCALE, result.message,
                    len(builder.cost), time.perf_counter() - start_time)


def _choice(problem: Problem, first: list, x) -> tuple:
    """The strategy index per class that the solver's values `x` take."""
    return tuple(int(np.argmax(x[f:f + len(c.strategies)]))
                 for f, c in zip(first, problem.classes))


def _row_terms(row, first):
    """(columns, values in MiB) of a memory row's strategy terms."""
    columns, values = [], []
    for c, sizes in row.coefficients.items():
        columns.extend(range(first[c], first[c] + len(sizes)))
        values.extend(np.asarray(sizes, np.float64) * _BYTES_SCALE)
    return columns, values


def smallest_memory(problem: Problem, time_limit: float = TIME_LIMIT_SECONDS) -> int:
    """The least, over every choice, of the fullest memory row (bytes per device)."""
    builder = _Builder()
    first = _choices(problem, builder, [np.zeros(len(c.strategies)) for c in problem.classes])
    peak = builder.variables([1.0], integral=False, upper=np.inf)
    for row in problem.memory:
        columns, values = _row_terms(row, first)
        builder.row(columns + [peak], values + [-1.0], -np.inf, -row.constant * _BYTES_SCALE)
    result = builder.solve(time_limit)
    choice = _choice(problem, first, result.x)
    return max((row.value(choice) for row in problem.memory), default=0)
