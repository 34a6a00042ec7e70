"""Tile assignments no order of the mesh axes gives (XLA accepts any): what they cost.

    .venv/bin/python benchmarks/tile_assignments.py [--mesh=2,4] [--big_mesh=16,32]

For each example sharding of a float32 tensor (8,), (8, 16) or (8, 16, 2) on an abstract --mesh (XLA's
devices named 0..N-1 row-major), lowered as an out_shardings entry, an in_shardings
entry and an annotation inside the program: the layout Sharding.placement takes, how
many devices hold another tile than the sharding names, and the program's collectives
as (kind, operand bytes per device). Then the seconds Sharding.placement takes for a
random tile assignment of --big_mesh's devices (median of --repeats), the beam search's
cost on a large mesh.
"""

import logging
import os
import sys
import time

from absl import app, flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gspmd_tf as gt  # noqa: E402
from gspmd_tf.layout import permute_pairs  # noqa: E402

MESH = flags.DEFINE_list("mesh", ["2", "4"], "the mesh the examples lower on")
BIG_MESH = flags.DEFINE_list("big_mesh", ["16", "32"], "the mesh placement is timed on")
REPEATS = flags.DEFINE_integer("repeats", 5, "timed placements on --big_mesh")

EXAMPLES = ("{devices=[8,1]0,2,1,3,4,5,6,7}", "{devices=[2,2,2]0,2,1,3,4,5,6,7}",
            "{devices=[2,1,4]0,1,2,4,3,5,6,7 last_tile_dim_replicate}")


def _collectives(lowered):
    return [(c.kind, c.bytes) for c in lowered.collectives()]


def main(argv):
    del argv
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    shape = [int(s) for s in MESH.value]
    names = tuple(f"a{i}" for i in range(len(shape)))
    mesh = gt.Mesh.abstract(shape, names)
    for text in EXAMPLES:
        sharding = gt.Sharding.parse(text)
        rank = len(sharding.tile_shape)
        x = tf.TensorSpec((8, 16, 2)[:rank], tf.float32)
        layout, placed = sharding.placement(mesh, rank)
        moved = sum(s != t for s, t in permute_pairs(mesh, layout, layout, placed, mesh))
        print(f"{text}: layout {layout.to_spec()!r}, {moved} of {mesh.size} devices hold "
              "another tile than it names")
        out = gt.lower(lambda v: v * 2.0, mesh, (gt.P(),), (sharding,), args=(x,))
        into = gt.lower(lambda v: v * 2.0, mesh, (sharding,), (gt.P(),), args=(x,))

        def annotated(v):
            return gt.mesh_split(tf.identity(v), mesh, sharding) * 2.0
        inside = gt.lower(annotated, mesh, (gt.P(),), (gt.P(),), args=(x,))
        print(f"  out_shardings: {_collectives(out)}")
        print(f"  in_shardings (replicated out): {_collectives(into)}")
        print(f"  annotation (replicated in and out): {_collectives(inside)}")
    big = [int(s) for s in BIG_MESH.value]
    big_mesh = gt.Mesh.abstract(big, tuple(f"b{i}" for i in range(len(big))))
    rng = np.random.default_rng(0)
    sharding = gt.Sharding.tile(rng.permutation(big_mesh.size).reshape(big))
    seconds = []
    for _ in range(REPEATS.value):
        start = time.perf_counter()
        sharding.placement(big_mesh, len(big))
        seconds.append(time.perf_counter() - start)
    print(f"placement of a random tile assignment on {big}: median "
          f"{np.median(seconds) * 1e3:.1f} ms of {REPEATS.value}")


if __name__ == "__main__":
    app.run(main)
