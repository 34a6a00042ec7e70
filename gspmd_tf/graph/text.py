"""A program as text: one node a line, control-flow bodies indented (Compiled.as_text,
Lowered.as_text("explicit" | "spmd"), and tests that check programs as text)."""

from __future__ import annotations

from gspmd_tf.graph.ir import Graph
from gspmd_tf.layout import Layout


def program_text(program: Graph, indent: str = "") -> str:
    """`program` one node a line: `%index = op(inputs) : shapes dtypes {params}` (a
    layout among the params printed as its PartitionSpec), a control-flow node's
    regions indented below it."""
    lines = []
    for i, node in enumerate(program.nodes):
        inputs = ", ".join(f"%{r.node}" + (f":{r.out}" if r.out else "") for r in node.inputs)
        types = ", ".join(f"{dtype.name}{list(shape) if shape is not None else '[?]'}"
                          for shape, dtype in zip(node.out_shapes, node.out_dtypes))
        params = (" {" + ", ".join(f"{k}={_param_text(v)}" for k, v in node.params.items())
                  + "}") if node.params else ""
        lines.append(f"{indent}%{i} = {node.op}({inputs}) : {types}{params}  # {node.name}")
        for k, region in enumerate(node.regions):
            lines.append(f"{indent}  region {k}:")
            lines.append(program_text(region, indent + "    "))
    outputs = ", ".join(f"%{r.node}" + (f":{r.out}" if r.out else "") for r in program.outputs)
    lines.append(f"{indent}return {outputs}")
    return "\n".join(lines)


def _param_text(value) -> str:
    """A gt.* node's param as program_text prints it: a Layout as its spec."""
    return str(value) if isinstance(value, Layout) else repr(value)
