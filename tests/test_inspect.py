"""Seeing what gspmd-tf chose: gt.visualize_sharding, the HTML report (rendered in headless
Chromium when it is installed), per-device memory."""

import os
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.layout import Layout

P = gt.P


def _cells(view):
    return [[(box, devices) for box, devices in row] for row in view.cells]


# --------------------------------------------------------------------------- visualize

def test_grid_of_a_tensor_split_on_both_axes(mesh):
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    x = gt.ShardedTensor.from_value(value, mesh, Layout.from_spec(mesh, P("data", "model"), 2))
    view = gt.visualize_sharding(x)
    assert len(view.cells) == 2 and len(view.cells[0]) == 4
    for r in range(2):
        for c in range(4):
            box, devices = view.cells[r][c]
            assert devices == (4 * r + c,)
            assert box == ((4 * r, 4 * r + 4), (2 * c, 2 * c + 2))
            # the device really holds that block
            np.testing.assert_array_equal(x.shards[devices[0]].numpy(),
                                          value[tuple(slice(a, b) for a, b in box)])
    text = str(view)
    lines = text.splitlines()
    assert lines[0].startswith("shape (8, 8) float32, spec P('data', 'model')")
    assert lines[1].startswith("┌") and lines[-1].startswith("└")
    assert [cell.strip() for cell in lines[2].split("│")[1:5]] == ["0", "1", "2", "3"]
    assert "4×2" in lines[3]


def test_partially_replicated_blocks_list_every_holder(mesh):
    x = gt.ShardedTensor.from_value(np.zeros((6, 4), np.float32), mesh,
                                    Layout.from_spec(mesh, P("data"), 2))
    view = gt.visualize_sharding(x)
    assert _cells(view) == [[(((0, 3), (0, 4)), (0, 1, 2, 3))],
                            [(((3, 6), (0, 4)), (4, 5, 6, 7))]]
    assert "0 1 2 3" in str(view) and "4 5 6 7" in str(view)


def test_uneven_variable_shows_real_block_sizes(mesh):
    v = gt.Variable(np.zeros((5, 10), np.float32), mesh=mesh, spec=P(None, "model"))
    view = gt.visualize_sharding(v)
    sizes = [box[1][1] - box[1][0] for box, _ in view.cells[0]]
    assert sizes == [3, 3, 3, 1]  # ceil-div blocks: the last device holds 1 real column
    assert [d for _, d in view.cells[0]] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert "5×1" in str(view)


def test_sharding_objects_need_a_shape(mesh):
    one_d = gt.visualize_sharding(gt.Sharding.parse("{devices=[4]0,1,2,3}"), shape=(10,))
    assert [box for box, _ in one_d.cells[0]] == [((0, 3),), ((3, 6),), ((6, 9),), ((9, 10),)]
    assert "all devices" in str(gt.visualize_sharding(gt.Sharding.replicate(), shape=(3,)))
    assert _cells(gt.visualize_sharding(gt.Sharding.maximal(5), shape=(2, 2))) == \
        [[(((0, 2), (0, 2)), (5,))]]

    class Named:  # what jax.sharding.NamedSharding offers
        def __init__(self, mesh, spec):
            self.mesh, self.spec = mesh, spec

    named = gt.visualize_sharding(Named(mesh, P("model")), shape=(8,))
    assert [d for _, d in named.cells[0]] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    with pytest.raises(gt.ShardingError, match="pass shape="):
        gt.visualize_sharding(gt.Sharding.replicate())
    with pytest.raises(gt.ShardingError, match="rank 3"):
        gt.visualize_sharding(gt.Sharding.replicate(), shape=(2, 2, 2))
    with pytest.raises(gt.ShardingError, match="got int"):
        gt.visualize_sharding(3)


def test_html_form_colors_each_device_set(mesh):
    x = gt.ShardedTensor.from_value(np.zeros((6, 4), np.float32), mesh,
                                    Layout.from_spec(mesh, P("data"), 2))
    page = gt.visualize_sharding(x)._repr_html_()
    cells = _parse(page).cells
    assert [c["text"] for c in cells] == ["0 1 2 3 3×4", "4 5 6 7 3×4"]
    assert cells[0]["style"] != cells[1]["style"]


# --------------------------------------------------------------------------- report

class _Page(HTMLParser):
    """The parts of a report page the tests check."""

    def __init__(self):
        super().__init__()
        self.ops, self.cells, self.tables, self.external = [], [], {}, []
        self._td, self._table = None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "g" and attrs.get("class") == "op":
            self.ops.append(attrs)
        if tag in ("script", "link", "img") or attrs.get("src"):
            self.external.append(tag)
        if tag == "table":
            self._table = attrs.get("class")
            self.tables.setdefault(self._table, [])
        if tag == "tr" and self._table:
            self.tables[self._table].append([])
        if tag == "td":
            self._td = {"style": attrs.get("style"), "text": ""}

    def handle_data(self, data):
        if self._td is not None:
            self._td["text"] = (self._td["text"] + " " + data).strip()

    def handle_endtag(self, tag):
        if tag == "td" and self._td is not None:
            self.cells.append(self._td)
            if self._table:
                self.tables[self._table][-1].append(self._td["text"])
            self._td = None


def _parse(page):
    parser = _Page()
    parser.feed(page)
    return parser


@pytest.fixture(scope="module")
def lowered(mesh):
    w = gt.Variable(np.ones((16, 8), np.float32), mesh=mesh, spec=P(None, "model"))

    @gt.function(mesh=mesh, in_shardings=(P("data"),))
    def layer(x):
        return tf.reduce_sum(tf.nn.relu(x @ w), axis=1)

    return layer.lower(np.ones((32, 16), np.float32)), w


def test_memory_counts_local_shards(lowered):
    low, _ = lowered
    memory = low.memory()
    assert memory.arguments == 16 * 16 * 4  # x's [16, 16] shard
    assert memory.variables == 16 * 2 * 4  # w's [16, 2] shard
    assert memory.outputs == 16 * 4  # the [16] output shard
    # the [16, 2] matmul result is live beside everything else
    assert memory.peak >= memory.arguments + memory.variables + memory.outputs + 16 * 2 * 4


def test_html_report_holds_graph_collectives_memory(lowered, tmp_path):
    low, _ = lowered
    path = tmp_path / "report.html"
    page = low.report(format="html", path=str(path))
    assert path.read_text(encoding="utf-8") == page
    parsed = _parse(page)
    assert not parsed.external  # self-contained
    ops = {op["data-name"]: op["data-spec"] for op in parsed.ops}
    assert len(ops) == len(low.graph.nodes)
    matmul = next(n.name for n in low.graph.nodes if n.op == "MatMul")
    assert ops[matmul] == repr(low.layout_of(matmul).to_spec()) == "P('data', 'model')"
    collectives = parsed.tables["collectives"][1:]
    assert [(row[0], int(row[3])) for row in collectives] == \
        [(c.kind, c.bytes) for c in low.collectives()] and collectives
    memory = dict((row[0], int(row[1])) for row in parsed.tables["memory"][1:])
    assert memory["variables"] == low.memory().variables
    with pytest.raises(gt.ShardingError, match="format"):
        low.report(format="pdf")


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's chromium is not installed (apt-get install chromium)")
def test_html_report_renders_in_headless_chromium(lowered, tmp_path):
    low, _ = lowered
    path = tmp_path / "report.html"
    low.report(format="html", path=str(path))
    shot = tmp_path / "shot.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(["chromium", *flags, "--dump-dom", path.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rendered = _parse(dom)  # what the browser built from the file
    assert len(rendered.ops) == len(low.graph.nodes)
    assert len(rendered.tables["collectives"]) == len(low.collectives()) + 1
    subprocess.run(["chromium", *flags, f"--screenshot={shot}", "--window-size=1200,900",
                    path.as_uri()], capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000  # a page with a drawn graph, not a blank one
    assert os.path.getsize(path) < 200_000


# --------------------------------------------------------------------------- warnings

def test_replicated_ops_warn_once_per_op_type_with_a_count(mesh, caplog):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)

    @gt.function(mesh=mesh, in_shardings=(P("data", "model"),))
    def cumulative(t):  # an op without a rule, twelve times, each on split operands
        for _ in range(12):
            t = tf.math.cumulative_logsumexp(t, axis=0) * 0.5
            t = gt.mesh_split(t, mesh, P("data", "model"))
        return t

    with caplog.at_level("WARNING", logger="gspmd_tf"):
        got = cumulative(x).numpy()
    want = x
    for _ in range(12):
        want = np.logaddexp.accumulate(want, axis=0) * 0.5
    np.testing.assert_allclose(got, want, rtol=1e-5)
    warnings = [r.getMessage() for r in caplog.records
                if "CumulativeLogsumexp" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        "gspmd_tf: 12 ops (CumulativeLogsumexp) have no partitioning rule")
    assert "... (2 more); splits lost: " in warnings[0]


def test_lowering_logs_progress_with_counts(mesh, caplog, monkeypatch):
    from gspmd_tf.spmd import partitioner
    monkeypatch.setattr(partitioner, "PROGRESS_EVERY", 4)

    @gt.function(mesh=mesh, in_shardings=(P("data"),))
    def chain(t):
        for _ in range(6):
            t = tf.tanh(t) * 2.0
        return t

    with caplog.at_level("INFO", logger="gspmd_tf"):
        low = chain.lower(np.ones((8, 4), np.float32))
    lines = [r.getMessage() for r in caplog.records]
    ops = len(low.graph.nodes)
    assert any(f".chain traced: {ops} ops (" in l for l in lines)
    assert any(f"partitioned 4 of {ops} ops" in l for l in lines)
    assert any("partitioned: " in l and "ops in the SPMD program" in l for l in lines)
