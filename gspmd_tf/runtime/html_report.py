"""The HTML report of a lowered program: one self-contained file (inline CSS and SVG, no
scripts, nothing fetched), to open in a browser or share.

It holds the traced op graph drawn as columns (an op's column is one past its deepest
input; only up to GRAPH_OPS_DRAWN ops, past which a drawing is unreadable), each op
colored by the sharding of its first output; the collectives of the SPMD program with
the ops that need them; a table per layer (name scope); the per-device memory with a
timeline of the estimated live bytes over the program, collectives marked; the time
table of each gt.pipeline_value_and_grad schedule in the program (found by its name
scope: which stage runs which microbatch's forward or backward at each slot); the
auto-sharding search's decisions (when an entry is gt.AUTO); and every
tensor's sharding, grouped by layer in collapsible sections (a layer whose ops need
collectives is marked, and so is each such op), so that a 10,000-op train step stays
readable.
"""

from __future__ import annotations

import html

from gspmd_tf.pipeline.schedule import schedules_in
from gspmd_tf.runtime.layers import LayerOf, layer_table
from gspmd_tf.runtime.memory import program_memory
from gspmd_tf.spmd.program import COLLECTIVES

_NODE_W, _NODE_H, _GAP_X, _GAP_Y = 150, 30, 50, 12
GRAPH_OPS_DRAWN = 400  # larger graphs are shown by layer only
ROWS_OPEN = 40  # longer tables start collapsed
_TIMELINE_W, _TIMELINE_H = 900, 160

_STYLE = """
body{font-family:sans-serif;margin:20px;color:#222}
table{border-collapse:collapse;margin:8px 0;font-family:monospace;font-size:12px}
td,th{border:1px solid #bbb;padding:3px 8px;text-align:left}
th{background:#eee}
.legend span{display:inline-block;padding:2px 8px;margin:2px;border:1px solid #888;
font-family:monospace;font-size:12px}
svg text{font-family:monospace;font-size:10px;pointer-events:none}
.graph{overflow:auto;border:1px solid #ccc;max-height:700px}
details{margin:2px 0 2px 14px}summary{cursor:pointer;font-family:monospace;font-size:12px}
details.coll>summary,tr.coll td{background:#fde0dc}
table.pipeline td{padding:2px 4px;text-align:center}
table.pipeline td.F{background:#cfe3fb}table.pipeline td.B{background:#d6f0d0}
table.pipeline td.idle{background:#f4f4f4;color:#aaa}
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


def _needs(collectives):
    """{op name: ["all-gather 256 B (operand layout)", ...]}: the collectives each op of
    the traced graph needs."""
    needs = {}
    for c in collectives:
        for origin in c.origins:
            needs.setdefault(origin.op, []).append(f"{c.kind} {origin.bytes} B ({origin.reason})")
    return needs


def _graph_svg(lowered, colors, needs):
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
        wanted = needs.get(node.name, ())
        tip = html.escape(f"{node.name} ({node.op}) {shape} {spec}"
                          + (" annotated" if annotated else "")
                          + "".join(f"; needs {w}" for w in wanted))
        stroke, width = ("#d33", 3) if wanted else ("#000", 2) if annotated else ("#666", 1)
        parts.append(
            f'<g class="op" data-name="{html.escape(node.name)}" data-spec="{html.escape(spec)}" '
            f'data-collectives="{len(wanted)}">'
            f'<title>{tip}</title><rect x="{x}" y="{y}" width="{_NODE_W}" height="{_NODE_H}" '
            f'rx="4" fill="{_color(spec, colors)}" stroke="{stroke}" '
            f'stroke-width="{width}"/>'
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


def _timeline_svg(memory, program):
    """The estimated live bytes per device over the program's nodes (the max of each
    pixel's nodes), a red tick at each collective."""
    line = memory.timeline
    if not line:
        return ""
    step = max(1, -(-len(line) // _TIMELINE_W))
    points = [max(line[i:i + step]) for i in range(0, len(line), step)]
    top = max(points) or 1
    scale_y = (_TIMELINE_H - 20) / top
    path = " ".join(f"{x},{_TIMELINE_H - 10 - v * scale_y:.1f}" for x, v in enumerate(points))
    ticks = "".join(f'<line x1="{i // step}" y1="0" x2="{i // step}" y2="8" stroke="#d33"/>'
                    for i, node in enumerate(program.nodes) if node.op in COLLECTIVES)
    return (f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" '
            f'width="{len(points) + 60}" height="{_TIMELINE_H}">{ticks}'
            f'<polyline fill="none" stroke="#36c" stroke-width="1" points="{path}"/>'
            f'<text x="{len(points) + 4}" y="14">{top} B</text></svg>')


def _ops_by_layer(lowered, needs):
    """Collapsible sections nested as the name scopes are: each scope's summary counts
    the ops, collectives and bytes of everything under it, and a layer's section holds
    its tensors (name, op, shape, sharding, annotated, the collectives its op needs);
    sections and rows with ops needing collectives are marked (class "coll")."""
    graph, layouts = lowered.graph, lowered.propagation.layouts
    layer_of = LayerOf([node.name for node in graph.nodes])
    rows = {}  # layer -> [(marked, cells)]
    for i, node in enumerate(graph.nodes):
        wanted = "; ".join(needs.get(node.name, ()))
        for k, shape in enumerate(node.out_shapes):
            name = node.name if k == 0 else f"{node.name}:{k}"
            rows.setdefault(layer_of(node.name), []).append((bool(wanted), (
                name, node.op, shape, repr(layouts[i][k].to_spec()),
                "yes" if (i, k) in lowered._annotated else "", wanted if k == 0 else "")))
    stats = {s.layer: s for s in lowered.layers()}
    children = {}  # scope path -> its child scope paths, in order of first op
    for layer in rows:
        parts = layer.split("/")
        for end in range(1, len(parts) + 1):
            parent, path = "/".join(parts[:end - 1]), "/".join(parts[:end])
            if path not in children.setdefault(parent, []):
                children[parent].append(path)

    def section(path):
        under = [s for layer, s in stats.items()
                 if layer == path or layer.startswith(path + "/")]
        count = sum(s.collectives for s in under)
        summary = (f"{html.escape(path.rsplit('/', 1)[-1])}: {sum(s.ops for s in under)} ops"
                   + (f", {count} collectives, {sum(s.collective_bytes for s in under)} B"
                      if count else ""))
        inner = "".join(section(child) for child in children.get(path, ()))
        if path in rows:
            inner += '<table class="tensors"><tr>' + "".join(
                f"<th>{h}</th>" for h in ("tensor", "op", "shape", "sharding", "annotated",
                                          "collectives its op needs")) + "</tr>" + "".join(
                f'<tr{" class=coll" if marked else ""}>'
                + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>"
                for marked, cells in rows[path]) + "</table>"
        cls = ' class="coll"' if count else ""
        return f"<details{cls}><summary>{summary}</summary>{inner}</details>"

    return "".join(section(path) for path in children.get("", ()))


def render_html(lowered, advice=None):
    """The report of `lowered` (a gt.Lowered) as one HTML document (a str), with the
    list of Advice `advice` when given."""
    colors = {}
    collectives = lowered.collectives()
    needs = _needs(collectives)
    drawn = len(lowered.graph.nodes) <= GRAPH_OPS_DRAWN
    svg = _graph_svg(lowered, colors, needs) if drawn else ""
    legend = "".join(f'<span style="background:{c}">{html.escape(s)}</span>'
                     for s, c in [("P()", "#dddddd")] + list(colors.items()))
    layers = layer_table(lowered.layers())
    memory = program_memory(lowered)
    annotated, inferred = lowered.counts()
    title = html.escape(lowered.name or "lowered program")
    replicated = lowered.program.replicated_ops
    return "".join([
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>',
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{title}</h1><p>mesh {html.escape(repr(lowered.mesh))}: {annotated} tensors "
        f"annotated, {inferred} sharded by inference, {len(collectives)} collectives "
        f"moving {sum(c.bytes for c in collectives)} bytes per device.</p>",
        ("<h2>Op graph</h2><p>Each box is an op of the traced function, colored by the "
         "sharding of its first output (black border: annotated; red: the op needs "
         "collectives); hover for name, shape and the collectives."
         f'</p><div class="legend">{legend}</div><div class="graph">{svg}</div>' if drawn
         else f"<h2>Op graph</h2><p>{len(lowered.graph.nodes)} ops: too many to draw "
         f"(more than {GRAPH_OPS_DRAWN}); see the tensors by layer below.</p>"),
        "<h2>Tensors by layer</h2><p>Name scopes, nested; click one to open it. Marked "
        "sections and rows hold ops that need collectives.</p>",
        _ops_by_layer(lowered, needs),
        ("<h2>Advice</h2><ul>" + "".join(f"<li>{html.escape(a.text())}</li>" for a in advice)
         + "</ul>" if advice else ""),
        "".join(_schedule_section(table)
                for table in schedules_in(node.name for node in lowered.graph.nodes)),
        "<h2>Per-device memory</h2><p>Every device runs the same program on equal (padded) "
        "local shapes. The peak is an estimate in program order; the line shows the live "
        "bytes over the program's ops (red ticks: collectives).</p>",
        _table(["", "bytes per device"],
               [("arguments", memory.arguments), ("variables", memory.variables),
                ("outputs", memory.outputs), ("peak (estimate)", memory.peak)], "memory"),
        _timeline_svg(memory, lowered.program.graph),
        "<h2>Collectives</h2>",
        _collapsible(f"{len(collectives)} collectives", _table(
            ["collective", "shape (per device)", "dtype", "bytes", "groups", "axes",
             "needed by (op, source line, tensor: from -> to, reason)"],
            [(c.kind, c.shape, c.dtype.name, c.bytes,
              f"{c.groups[0] if c.groups else ()} x{len(c.groups)}", c.axes,
              "; ".join(origin.text() for origin in c.origins))
             for c in collectives], "collectives"), len(collectives)),
        "<h2>Per layer</h2><p>Ops grouped by name scope (gradient ops in the layer they "
        "differentiate): the collectives they need, those collectives' bytes and the "
        "bytes of the tensors they produce, per device.</p>",
        _collapsible(f"{len(layers) - 1} layers", _table(layers[0], layers[1:], "layers"),
                     len(layers) - 1),
        ("<h2>Ran replicated (no rule)</h2><p>" + html.escape(", ".join(replicated)) + "</p>"
         if replicated else ""),
        ("<h2>Auto-sharding</h2><p>What the search chose for each gt.AUTO entry, with "
         "every alternative's modelled cost (lowered.auto_report()).</p><pre>"
         + html.escape(lowered.auto_report()) + "</pre>"
         if lowered.auto_plan is not None else ""),
        "</body></html>"])


def _schedule_section(table):
    """A pipeline's time table (gt.pipeline_schedule's, as its text() shows it): a row
    per stage, a column per slot, "F3" the forward of microbatch 3, "B3" its backward,
    idle slots marked."""
    slots = len(table.cells[0])
    rows = "".join(
        f"<tr><th>stage {stage}</th>" + "".join(
            f'<td class="{cell[0] if cell else "idle"}">{html.escape(cell or ".")}</td>'
            for cell in row) + "</tr>"
        for stage, row in enumerate(table.cells))
    return (f"<h2>Pipeline schedule ({html.escape(table.schedule)})</h2>"
            f"<p>S={table.stages} stages, M={table.microbatches} microbatches, "
            f"V={table.virtual}: "
            f"bubble {table.bubble} = {float(table.bubble):.3f} (idle slots, marked .). "
            "Each slot is one forward (F) or backward (B) of a stage (of one of its V "
            "layers, interleaved; .k: repeat k).</p>"
            '<table class="pipeline"><tr><th>slot</th>'
            + "".join(f"<th>{j}</th>" for j in range(slots)) + f"</tr>{rows}</table>")


def _collapsible(summary, content, rows):
    """`content` in a section that starts open when it has at most ROWS_OPEN `rows`."""
    state = " open" if rows <= ROWS_OPEN else ""
    return f"<details{state}><summary>{html.escape(summary)}</summary>{content}</details>"
