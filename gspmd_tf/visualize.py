"""gt.visualize_sharding: which device holds which block of a 1-D or 2-D tensor.

    >>> print(gt.visualize_sharding(x))          # x: ShardedTensor, gt.Variable, ...
    shape (8, 6) float32, spec P('data', 'model') on <Mesh data=2, model=2>
    ┌─────┬─────┐
    │  0  │  1  │
    │ 4×3 │ 4×3 │
    ├─────┼─────┤
    ...

Each cell is one block of the tensor (a tile of the sharding): the device ids holding it
(every copy of a replicated or partially replicated block) and the block's real size
(uneven splits give smaller or empty last blocks, as gspmd-tf pads them). In a notebook
the returned view renders as an HTML table, cells colored by the devices holding them.
"""

from __future__ import annotations

import html

import numpy as np

from gspmd_tf.errors import ShardingError
from gspmd_tf.layout import ceil_div
from gspmd_tf.sharding import MANUAL, MAXIMAL, REPLICATED, Sharding

__all__ = ["ShardingView", "visualize_sharding"]


class ShardingView:
    """The blocks of a sharded 1-D or 2-D tensor: `cells[row][col]` is (box, device ids),
    a box being the (start, stop) of the global elements per dim; device ids is None for
    a replicated sharding given without a mesh (every device).

    str() is a text grid; in notebooks `_repr_html_` shows an HTML table.
    """

    def __init__(self, shape, cells, title):
        self.shape = tuple(shape)
        self.cells = cells
        self.title = title

    # ------------------------------------------------------------------ text
    def _lines(self, box, devices):
        held = "all devices" if devices is None else " ".join(str(d) for d in devices)
        size = "×".join(str(b - a) for a, b in box) if box else "scalar"
        return [held, size]

    def text(self):
        """The grid drawn with box-drawing characters, one cell per block."""
        rows = [[self._lines(box, devices) for box, devices in row] for row in self.cells]
        widths = [max(len(line) for row in rows for line in row[j]) + 2
                  for j in range(len(rows[0]))]

        def rule(left, middle, right):
            return left + middle.join("─" * w for w in widths) + right

        out = [self.title, rule("┌", "┬", "┐")]
        for r, row in enumerate(rows):
            for k in range(2):
                out.append("│" + "│".join(cell[k].center(w) for cell, w in zip(row, widths))
                           + "│")
            out.append(rule("├", "┼", "┤") if r + 1 < len(rows) else rule("└", "┴", "┘"))
        return "\n".join(out)

    def __str__(self):
        return self.text()

    __repr__ = __str__

    # ------------------------------------------------------------------ html
    def html(self):
        """A self-contained HTML table (inline styles), cells colored by device set."""
        colors = {}
        parts = [f'<div class="gt-sharding"><div style="font-family:monospace">'
                 f'{html.escape(self.title)}</div>'
                 '<table style="border-collapse:collapse;font-family:monospace">']
        for row in self.cells:
            parts.append("<tr>")
            for box, devices in row:
                key = None if devices is None else tuple(devices)
                # golden-angle hues: neighbouring device sets get distinct colors
                hue = colors.setdefault(key, (len(colors) * 137) % 360)
                held, size = self._lines(box, devices)
                where = ", ".join(f"{a}:{b}" for a, b in box)
                parts.append(
                    f'<td title="elements [{where}]" style="border:1px solid #333;'
                    f'padding:6px 14px;text-align:center;background:hsl({hue},70%,82%)">'
                    f'{html.escape(held)}<br><small>{html.escape(size)}</small></td>')
            parts.append("</tr>")
        parts.append("</table></div>")
        return "".join(parts)

    def _repr_html_(self):
        return self.html()


def _blocks(sharding, shape, num_devices):
    """cells[row][col] = (box, device ids) of `sharding` on a tensor of `shape`."""
    if sharding.kind == MANUAL:
        raise ShardingError("visualize_sharding: a manual sharding has no blocks to draw")
    whole = tuple((0, n) for n in shape)
    if sharding.kind == REPLICATED:
        devices = None if num_devices is None else tuple(range(num_devices))
        return [[(whole, devices)]]
    if sharding.kind == MAXIMAL:
        return [[(whole, (sharding.device,))]]
    tiles = sharding.tile_assignment
    if not sharding.last_tile_dim_replicate:
        tiles = tiles[..., np.newaxis]
    grid = tiles.shape[:-1]
    if len(grid) != len(shape):
        raise ShardingError(
            f"visualize_sharding: sharding {sharding} tiles {len(grid)} dims but the shape "
            f"{tuple(shape)} has {len(shape)}; pass the tensor's shape")

    def box(index):
        out = []
        for i, n, t in zip(index, shape, grid):
            start = min(n, i * ceil_div(n, t))  # gspmd-tf's (and XLA's) ceil-div blocks
            out.append((start, min(n, start + ceil_div(n, t))))
        return tuple(out)

    blocks = [(box(i), tuple(int(d) for d in tiles[i])) for i in np.ndindex(*grid)]
    columns = grid[-1] if len(grid) == 2 else len(blocks)
    return [blocks[r:r + columns] for r in range(0, len(blocks), columns)]


def visualize_sharding(sharding_or_tensor, shape=None):
    """A ShardingView (print it; notebooks render it as HTML) of how a 1-D or 2-D tensor
    is split over devices.

    sharding_or_tensor: a gt.ShardedTensor or gt.Variable (shape and mesh taken from it;
      also a Keras variable of a gt.keras.shard_model model),
      a gt.Sharding (pass `shape`), or a NamedSharding-like object with `.mesh` and
      `.spec` (pass `shape`).
    """
    value = sharding_or_tensor
    if not hasattr(value, "layout") and hasattr(getattr(value, "_value", None), "layout"):
        value = value._value  # a Keras variable backed by a gt.Variable (gt.keras)
    mesh = getattr(value, "mesh", None)
    if hasattr(value, "layout") and mesh is not None:  # ShardedTensor, gt.Variable
        shape = tuple(int(n) for n in value.shape) if shape is None else shape
        sharding = Sharding.from_layout(mesh, value.layout)
        dtype = getattr(value.dtype, "name", str(value.dtype))
        title = f"shape {tuple(shape)} {dtype}, spec {value.layout.to_spec()!r} on {mesh!r}"
    elif mesh is not None and hasattr(value, "spec"):  # NamedSharding-like
        if shape is None:
            raise ShardingError("visualize_sharding: pass shape= with a (mesh, spec) sharding")
        sharding = Sharding.from_spec(mesh, value.spec, len(shape), "visualize_sharding")
        title = f"shape {tuple(shape)}, spec {value.spec!r} on {mesh!r}"
    elif isinstance(value, Sharding):
        if shape is None:
            raise ShardingError("visualize_sharding: pass shape= with a gt.Sharding")
        sharding = value
        title = f"shape {tuple(shape)}, sharding {value}"
    else:
        raise ShardingError(
            f"visualize_sharding takes a gt.ShardedTensor, gt.Variable, gt.Sharding or an "
            f"object with .mesh and .spec, got {type(value).__name__}")
    shape = tuple(int(n) for n in shape)
    if len(shape) > 2:
        raise ShardingError(
            f"visualize_sharding draws 1-D and 2-D tensors; shape {shape} has rank "
            f"{len(shape)}")
    num_devices = mesh.size if mesh is not None else None
    return ShardingView(shape, _blocks(sharding, shape, num_devices), title)
