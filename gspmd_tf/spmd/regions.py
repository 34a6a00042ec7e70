"""Whether the bodies of a control-flow op only read a variable handle it takes.

gt.function lets a program read a variable of another mesh (its value is resharded in)
but not update it; a handle passed into a While / If / Case counts as read when the
bodies only read it (runtime/lowering.py follows the handle through such ops).
"""

from __future__ import annotations

from gspmd_tf.graph.ir import REGION_OPS


def reads_only(node, p):
    """Whether the regions of control-flow `node` only read the variable handle that is
    its input `p`: ReadVariableOps of it, and a While body returning it unchanged."""
    first = REGION_OPS[node.op][1]
    if p < first:
        return False
    j, loop = p - first, "While" in node.op
    if not all(_only_read(region, j, loop) for region in node.regions):
        return False
    body = node.regions[-1]
    return not loop or body.outputs[j] == body.inputs[j]  # a loop must hand it on


def _only_read(region, j, loop):
    """Whether region parameter `j` is only read (ReadVariableOp) in `region`, or, in a
    loop, also returned unchanged as result `j`."""
    param = region.inputs[j]
    if any(param in node.inputs and node.op != "ReadVariableOp" for node in region.nodes):
        return False
    return all(ref != param or (loop and k == j) for k, ref in enumerate(region.outputs))
