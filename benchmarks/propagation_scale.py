"""Sharding propagation alone on a synthetic graph of a million ops.

    .venv/bin/python benchmarks/propagation_scale.py --ops=1000000

The graph is built directly in the IR (gspmd_tf.graph.ir.Graph), not traced through TF:
a chain of blocks, each

    w_i = Placeholder [D, D]                  (a weight; no rule)
    y   = MatMul(x, w_i)                      [B, D]
    z   = AddV2(y, x)                         [B, D]      residual: a ladder, not a chain
    r   = Relu(z)                             [B, D]
    s   = Reshape(r, [B, H, D/H])
    t   = Transpose(s, perm=[1, 0, 2])        [H, B, D/H]
    u   = Transpose(t, perm=[1, 0, 2])        [B, H, D/H]
    x'  = Reshape(u, [B, D])

(8 nodes, 7 with a rule; three shared Const nodes hold the shapes and the permutation).
Seeds: the first input x0 is P("data") and the first weight P(None, "model"); with
--seed_every=K every K-th weight is also annotated P(None, "model"). Everything else is
inferred, so the shardings must travel the length of the graph.

gspmd_tf.propagation.propagate.propagate() is encode() (rule look-up, built once per
distinct rule, and the per-node loop in Cython, csrc/encode.pyx), run() (the Cython
fixpoint, csrc/propagation.pyx) and decode() (layouts are decoded on first use); each
stage is timed on its own:

    encode   rule look-up + array building
    core     the Cython fixpoint (propagate_arrays)
    decode   wrapping the arrays (layouts themselves are decoded on first use)

The core is then re-run --core_repeats times on fresh copies of the captured arrays
(median reported). --rules_alone also times rule_for() over all nodes by itself (no
cache), for comparison.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

OPS = flags.DEFINE_integer("ops", 1_000_000, "number of graph nodes (approximately)")
BATCH = flags.DEFINE_integer("batch", 64, "B")
WIDTH = flags.DEFINE_integer("width", 256, "D")
HEADS = flags.DEFINE_integer("heads", 8, "H (divides D)")
MESH = flags.DEFINE_string("mesh", "2,4", "abstract mesh shape (axes data, model)")
SEED_EVERY = flags.DEFINE_integer("seed_every", 0,
                                  "also annotate every K-th weight (0: only the first)")
CORE_REPEATS = flags.DEFINE_integer("core_repeats", 5, "extra timed runs of the core alone")
RULES_ALONE = flags.DEFINE_bool("rules_alone", True, "also time rule_for() over all nodes")
NO_GC = flags.DEFINE_bool("disable_gc", False,
                          "turn Python's cyclic GC off while timing (to see its share)")

NODES_PER_BLOCK = 8


def build_graph(num_ops, b, d, h):
    """The synthetic IR graph and its seeds' Refs (x0, the weights)."""
    import tensorflow as tf
    from tensorflow.core.framework import attr_value_pb2
    from gspmd_tf.graph.ir import Graph, Node, Ref

    f32, i32 = tf.float32, tf.int32

    def const(name, value):
        value = np.asarray(value, np.int32)
        attrs = {"value": attr_value_pb2.AttrValue(tensor=tf.make_tensor_proto(value)),
                 "dtype": attr_value_pb2.AttrValue(type=i32.as_datatype_enum)}
        return Ref(g.add(Node(name, "Const", (), attrs, [value.shape], [i32])), 0)

    g = Graph()
    shape3 = const("shape3", [b, h, d // h])
    shape2 = const("shape2", [b, d])
    perm = const("perm", [1, 0, 2])
    x = Ref(g.add(Node("x0", "Placeholder", (), {}, [(b, d)], [f32])), 0)
    g.inputs.append(x)
    weights = []
    blocks = max(1, (num_ops - 4) // NODES_PER_BLOCK)
    add = g.add
    for i in range(blocks):
        w = Ref(add(Node(f"w{i}", "Placeholder", (), {}, [(d, d)], [f32])), 0)
        g.inputs.append(w)
        weights.append(w)
        y = Ref(add(Node(f"mm{i}", "MatMul", (x, w), {}, [(b, d)], [f32])), 0)
        z = Ref(add(Node(f"add{i}", "AddV2", (y, x), {}, [(b, d)], [f32])), 0)
        r = Ref(add(Node(f"relu{i}", "Relu", (z,), {}, [(b, d)], [f32])), 0)
        s = Ref(add(Node(f"rs{i}", "Reshape", (r, shape3), {}, [(b, h, d // h)], [f32])), 0)
        t = Ref(add(Node(f"tr{i}", "Transpose", (s, perm), {}, [(h, b, d // h)], [f32])), 0)
        u = Ref(add(Node(f"tb{i}", "Transpose", (t, perm), {}, [(b, h, d // h)], [f32])), 0)
        x = Ref(add(Node(f"rb{i}", "Reshape", (u, shape2), {}, [(b, d)], [f32])), 0)
    g.outputs.append(x)
    return g, weights


def main(argv):
    del argv
    import gspmd_tf as gt
    from gspmd_tf import _propagation
    from gspmd_tf.layout import Layout
    from gspmd_tf.propagation.propagate import decode, encode, run
    from gspmd_tf.registry import rule_for

    shape = tuple(int(s) for s in MESH.value.split(","))
    mesh = gt.Mesh.abstract(shape, ("data", "model"))
    b, d, h = BATCH.value, WIDTH.value, HEADS.value

    print("# propagation on a synthetic graph\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}; load average at start {os.getloadavg()[0]:.2f}; "
          f"abstract mesh {shape}; B={b} D={d} H={h}; Python GC "
          f"{'off' if NO_GC.value else 'on'} while timing\n")
    if NO_GC.value:
        gc.disable()

    t0 = time.perf_counter()
    graph, weights = build_graph(OPS.value, b, d, h)
    build_s = time.perf_counter() - t0
    num_tensors = sum(len(n.out_shapes) for n in graph.nodes)

    seeds = {graph.inputs[0]: Layout.from_spec(mesh, gt.P("data"), 2)}
    for i, w in enumerate(weights):
        if i == 0 or (SEED_EVERY.value and i % SEED_EVERY.value == 0):
            seeds[w] = Layout.from_spec(mesh, gt.P(None, "model"), 2)

    rules_s = None
    if RULES_ALONE.value:
        gc.collect()
        t0 = (time.perf_counter(), time.process_time())
        for node in graph.nodes:
            rule_for(graph, node)
        rules_s = (time.perf_counter() - t0[0], time.process_time() - t0[1])

    gc.collect()
    clock = lambda: (time.perf_counter(), time.process_time())
    t0 = clock()
    encoded = encode(graph, mesh, seeds)
    t1 = clock()
    core_args = [a.copy() if isinstance(a, np.ndarray) else a for a in encoded.core_args]
    t2 = clock()  # the copy (kept for the re-runs below) is not timed
    sweeps = run(encoded)
    t3 = clock()
    result = decode(graph, mesh, encoded, sweeps)
    t4 = clock()
    span = lambda a, b: (b[0] - a[0], b[1] - a[1])  # (wall, cpu)
    encode_s, core_s, decode_s = span(t0, t1), span(t2, t3), span(t3, t4)
    num_rule_ops = len(core_args[6]) - 1  # slot_start has one entry per op + 1

    # The core alone, again, on fresh copies of its input arrays.
    core_runs = []
    for _ in range(CORE_REPEATS.value):
        args = [a.copy() if isinstance(a, np.ndarray) else a for a in core_args]
        c0 = (time.perf_counter(), time.process_time())
        sweeps = _propagation.propagate_arrays(*args)
        core_runs.append(span(c0, (time.perf_counter(), time.process_time())))
        assert sweeps == result.sweeps
    core_median = (statistics.median(r[0] for r in core_runs),
                   statistics.median(r[1] for r in core_runs)) if core_runs else core_s

    last = graph.outputs[0]
    sharded = sum(1 for outs in result.layouts for l in outs if not l.is_replicated)
    print(f"graph: {len(graph.nodes)} nodes ({num_rule_ops} with a rule), {num_tensors} "
          f"tensors, {len(seeds)} seeds; built in {build_s:.1f} s (not in the table)")
    print(f"result: {result.sweeps} sweeps; {sharded} tensors sharded; last tensor "
          f"{result.layout(last).to_spec()!r}; last weight "
          f"{result.layout(weights[-1]).to_spec()!r}\n")
    print("| stage | wall s | CPU s | wall µs per node |")
    print("|---|---:|---:|---:|")
    n = len(graph.nodes)
    rows = [("encode (rule_for + arrays)", encode_s)]
    if rules_s is not None:
        rows.append(("  of which rule_for() alone (separate run)", rules_s))
    rows += [("core: propagate_arrays (inside propagate())", core_s),
             (f"core: propagate_arrays, median of {len(core_runs)} re-runs", core_median),
             ("decode (arrays -> Layouts)", decode_s),
             ("propagate() total (encode + core + decode)",
              (encode_s[0] + core_s[0] + decode_s[0], encode_s[1] + core_s[1] + decode_s[1]))]
    for label, (wall, cpu) in rows:
        print(f"| {label} | {wall:.3f} | {cpu:.3f} | {wall / n * 1e6:.2f} |")
    total = encode_s[0] + core_s[0] + decode_s[0]
    target = "met" if total <= 2.0 else "NOT met"
    print(f"\npropagate() target (<= 2 s end to end for {n} nodes): {target} ({total:.3f} s); "
          f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
