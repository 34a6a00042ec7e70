"""The HTML report of a lowered program: one self-contained file (inline CSS and SVG, no
scripts, nothing fetched), to open in a browser or share.

It holds the traced op graph drawn as layers (an op's column is one past its deepest
input), each op colored by the sharding of its first output; the collectives of the SPMD
program with their bytes; the per-device memory; the auto-sharding search's decisions
(when an entry is gt.AUTO); and the table of every tensor's sharding, as in the text
report.
"""

from __future__ import annotations

import html

from gspmd_tf.runtime.memory import program_memory

_NODE_W, _NODE_H, _GAP_X, _GAP_Y = 150, 30, 50, 12

_STYLE = """
body{font-family:sans-serif;margin:20px;color:#222}
table{border-collapse:collapse;margin:8px 0;font-family:monospace;font-size:12px}
td,th{border:1px solid #bbb;padding:3px 8px;text-align:left}
th{background:#eee}
.legend span{display:inline-block;padding:2px 8px;margin:2px;border:1px solid #888;
font-family:monospace;font-size:12px}
svg text{font-family:monospace;font-size:10px;pointer-events:none}
.graph{overflow:auto;border:1px solid #ccc;max-height:700px}
"""


def _color(spec_text, colors):
    """A fill color per distinct sharding; replicated tensors are grey."""
    if spec_text == "P()":
        return "#dddddd"
    if spec_text not in colors:
        colors[spec_text] = f"hsl({(len(colors) * 137 + 200) % 360},65%,75%)"
    return colors[spec_text]


def _levels(graph):
    """Column of every node: one past the deepest of its inputs (nodes are in
    topological order)."""
    level = []
    for node in graph.nodes:
        level.append(1 + max((level[r.node] for r in node.inputs), default=-1))
    return level


def _graph_svg(lowered, colors):
    graph, layouts = lowered.graph, lowered.propagation.layouts
    level = _levels(graph)
    rows, position = {}, []
    for lv in level:
        position.append((lv, rows.get(lv, 0)))
        rows[lv] = rows.get(lv, 0) + 1
    width = (max(level, default=0) + 1) * (_NODE_W + _GAP_X)
    height = max(rows.values(), default=1) * (_NODE_H + _GAP_Y) + _GAP_Y

    def corner(i):
        lv, row = position[i]
        return lv * (_NODE_W + _GAP_X) + 10, row * (_NODE_H + _GAP_Y) + _GAP_Y

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    for i, node in enumerate(graph.nodes):
        x, y = corner(i)
        for ref in node.inputs:
            px, py = corner(ref.node)
            parts.append(f'<line x1="{px + _NODE_W}" y1="{py + _NODE_H // 2}" x2="{x}" '
                         f'y2="{y + _NODE_H // 2}" stroke="#999" stroke-width="1"/>')
    for i, node in enumerate(graph.nodes):
        x, y = corner(i)
        spec = repr(layouts[i][0].to_spec()) if node.out_shapes else "P()"
        shape = node.out_shapes[0] if node.out_shapes else ()
        annotated = (i, 0) in lowered._annotated
        tip = html.escape(f"{node.name} ({node.op}) {shape} {spec}"
                          + (" annotated" if annotated else ""))
        parts.append(
            f'<g class="op" data-name="{html.escape(node.name)}" data-spec="{html.escape(spec)}">'
            f'<title>{tip}</title><rect x="{x}" y="{y}" width="{_NODE_W}" height="{_NODE_H}" '
            f'rx="4" fill="{_color(spec, colors)}" stroke="{"#000" if annotated else "#666"}" '
            f'stroke-width="{2 if annotated else 1}"/>'
            f'<text x="{x + 4}" y="{y + 12}">{html.escape(node.op[:22])}</text>'
            f'<text x="{x + 4}" y="{y + 25}">{html.escape(spec[:22])}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def _table(header, rows, cls):
    out = [f'<table class="{cls}"><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in header)
           + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return "".join(out)


def render_html(lowered):
    """The report of `lowered` (a gt.Lowered) as one HTML document (a str)."""
    colors = {}
    svg = _graph_svg(lowered, colors)
    legend = "".join(f'<span style="background:{c}">{html.escape(s)}</span>'
                     for s, c in [("P()", "#dddddd")] + list(colors.items()))
    collectives = lowered.collectives()
    memory = program_memory(lowered)
    annotated, inferred = lowered.counts()
    tensors = []
    for i, node in enumerate(lowered.graph.nodes):
        for k, shape in enumerate(node.out_shapes):
            name = node.name if k == 0 else f"{node.name}:{k}"
            tensors.append((name, node.op, shape,
                            repr(lowered.propagation.layouts[i][k].to_spec()),
                            "yes" if (i, k) in lowered._annotated else ""))
    title = html.escape(lowered.name or "lowered program")
    replicated = lowered.program.replicated_ops
    return "".join([
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>',
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{title}</h1><p>mesh {html.escape(repr(lowered.mesh))}: {annotated} tensors "
        f"annotated, {inferred} sharded by inference, {len(collectives)} collectives "
        f"moving {sum(c.bytes for c in collectives)} bytes per device.</p>",
        "<h2>Op graph</h2><p>Each box is an op of the traced function, colored by the "
        "sharding of its first output (thick border: annotated); hover for name and shape."
        f'</p><div class="legend">{legend}</div><div class="graph">{svg}</div>',
        "<h2>Collectives</h2>",
        _table(["collective", "shape (per device)", "dtype", "bytes", "groups", "axes"],
               [(c.kind, c.shape, c.dtype.name, c.bytes,
                 f"{c.groups[0] if c.groups else ()} x{len(c.groups)}", c.axes)
                for c in collectives], "collectives"),
        "<h2>Per-device memory</h2><p>Every device runs the same program on equal (padded) "
        "local shapes. The peak is an estimate in program order.</p>",
        _table(["", "bytes per device"],
               [("arguments", memory.arguments), ("variables", memory.variables),
                ("outputs", memory.outputs), ("peak (estimate)", memory.peak)], "memory"),
        ("<h2>Ran replicated (no rule)</h2><p>" + html.escape(", ".join(replicated)) + "</p>"
         if replicated else ""),
        ("<h2>Auto-sharding</h2><p>What the search chose for each gt.AUTO entry, with "
         "every alternative's modelled cost (lowered.auto_report()).</p><pre>"
         + html.escape(lowered.auto_report()) + "</pre>"
         if lowered.auto_plan is not None else ""),
        "<h2>Tensors</h2>",
        _table(["tensor", "op", "shape", "sharding", "annotated"], tensors, "tensors"),
        "</body></html>"])
