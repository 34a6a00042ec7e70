"""Cold planning time and bytes of the reshard planner over every pair of layouts (or a
sample of them) of a rank-3 tensor, mesh by mesh: what the planner's search costs on a
plan not in its cache, and how many bytes its plans move.

    .venv/bin/python benchmarks/planner_search.py
    .venv/bin/python benchmarks/planner_search.py --meshes=2x4,16x32 --pairs=400

Run it in two checkouts (before / after a planner change) to compare: it uses only
planner.plan, planner.cost and the plan cache's cache_clear(). Layouts place each mesh
axis on one of the tensor's dims (in any order within a dim) or nowhere; with more than
--pairs pairs, a --seed sample. Each plan is timed once, its cache cleared first; the
table gives the total and the slowest plan (wall ms) and the bytes all plans move per
device (the planner's ring model).
"""

import itertools
import logging
import os
import random
import sys
import time

from absl import app, flags
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gspmd_tf as gt  # noqa: E402
from gspmd_tf.layout import Layout  # noqa: E402
from gspmd_tf.spmd import planner  # noqa: E402

MESHES = flags.DEFINE_list("meshes", ["2x4", "4x2", "2x2x2", "4x8", "16x32", "2x4x8"],
                           "mesh shapes (axes named a, b, c)")
SHAPE = flags.DEFINE_list("shape", ["64", "512", "1024"], "global tensor shape (float32)")
PAIRS = flags.DEFINE_integer("pairs", 400, "at most this many (src, dst) pairs per mesh")
SEED = flags.DEFINE_integer("seed", 0, "seed of the pair sample")


def layouts(names, rank):
    """Every layout placing each axis on a dim (any order within a dim) or nowhere."""
    out = set()
    for order in itertools.permutations(names):
        for where in itertools.product(range(-1, rank), repeat=len(names)):
            dims = [[] for _ in range(rank)]
            for name, d in zip(order, where):
                if d >= 0:
                    dims[d].append(name)
            out.add(Layout(tuple(tuple(d) for d in dims)))
    return sorted(out, key=str)


def main(argv):
    del argv
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    shape = tuple(int(n) for n in SHAPE.value)
    print("| mesh | pairs | total ms | slowest ms | bytes moved (sum over pairs) |")
    print("|---|---:|---:|---:|---:|")
    for text in MESHES.value:
        sizes = tuple(int(n) for n in text.split("x"))
        names = "abc"[:len(sizes)]
        mesh = gt.Mesh.abstract(sizes, tuple(names))
        pairs = [(s, d) for s in layouts(names, len(shape))
                 for d in layouts(names, len(shape)) if s != d]
        if len(pairs) > PAIRS.value:
            pairs = random.Random(SEED.value).sample(pairs, PAIRS.value)
        total, slowest, moved = 0.0, 0.0, 0
        for src, dst in pairs:
            planner._plan.cache_clear()
            start = time.perf_counter()
            steps = planner.plan(src, dst, shape, tf.float32, mesh)
            took = time.perf_counter() - start
            total, slowest = total + took, max(slowest, took)
            moved += planner.cost(steps).bytes
        print(f"| {text} | {len(pairs)} | {total * 1e3:.1f} | {slowest * 1e3:.2f} | "
              f"{moved:,} |")


if __name__ == "__main__":
    app.run(main)
