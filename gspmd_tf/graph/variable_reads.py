"""Which ops may update the variable behind a resource handle.

gt.function lets a program read a variable of another mesh (its value is resharded in)
but not update it (runtime/lowering.py asks first_writer). A handle passed into a While /
If / Case counts as read when the bodies only read it.
"""

from __future__ import annotations

from typing import Optional

from gspmd_tf.graph.ir import REGION_OPS, Graph, Node, Ref
from gspmd_tf.registry import READS_VARIABLE, has_trait


def first_writer(graph: Graph, ref: Ref) -> Optional[Node]:
    """The first node that may update the variable of resource `ref` (anything but a
    known read, through Identity and control-flow ops whose bodies only read it), or
    None."""
    users = graph.consumers()
    pending = [ref]
    while pending:
        ref = pending.pop()
        for user, pos in users[ref.node]:
            node = graph.nodes[user]
            if node.inputs[pos] != ref:
                continue
            if node.op == "Identity":
                pending.append(Ref(user, 0))
            elif node.regions and reads_only(node, pos):
                if "While" in node.op:  # the loop hands the handle on as its output pos
                    pending.append(Ref(user, pos))
            elif not has_trait(node.op, READS_VARIABLE):
                return node
    return None


def reads_only(node: Node, p: int) -> bool:
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
