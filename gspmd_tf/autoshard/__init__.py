"""Auto-sharding: choose a layout for every gt.AUTO entry of in_shardings /
out_shardings under a per-device memory limit (gt.function(..., memory_limit=BYTES)).

A stage between propagate and partition (runtime/lowering.py drives it):

    strategies.py  candidates of one op from its registry rule (which mesh axes split
                   which factor), and of an input tensor (which axes split which dim)
    clusters.py    nodes of repeated layers grouped into classes that share one decision
    ties.py        AUTO inputs meeting in element-wise ops (a weight and its optimizer
                   slots) share one decision
    follow.py      element-wise classes that take their operand's layout (no decision)
    problem.py     node costs, edge (reshard) costs and memory rows priced by the one
                   cost model (cost_model.CostModel, spmd/planner.plan)
    solve.py       the integer program (scipy.optimize.milp, HiGHS)
    search.py      choose(): all of it, giving an AutoPlan (plan.py: decisions, report)

Only this module's `AUTO` is imported by the stages below runtime; the search itself is
imported by the lowering.
"""

from gspmd_tf.autoshard.spec import AUTO, is_auto

__all__ = ["AUTO", "is_auto"]
