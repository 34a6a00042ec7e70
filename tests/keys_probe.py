"""Prints the collective keys of one gt.function program as JSON, after first compiling
the warm-up programs named in argv[1] (comma-separated, in that order).

Run in fresh processes by tests/test_collective_keys.py: processes that build the same
program must give it the same keys, whatever they compiled before.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import gspmd_tf as gt  # noqa: E402
gt.configure_cpu_devices(8)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

P = gt.P
mesh = gt.Mesh.create((2, 4), ("data", "model"))
x = np.ones((8, 16), np.float32)


def warm_up(name):
    """Compiles another program, forming other device groups and instance keys."""
    if name == "sum":
        f = gt.function(lambda v: tf.reduce_sum(v, 0), mesh=mesh, in_shardings=(P("data"),))
    elif name == "gather":
        f = gt.function(lambda v: v * 2.0, mesh=mesh, in_shardings=(P("data", "model"),),
                        out_shardings=(P(),))
    elif name == "other_mesh":
        other = gt.Mesh.create((4, 2), ("a", "b"))
        f = gt.function(lambda v: tf.reduce_max(v, 1), mesh=other, in_shardings=(P("a", "b"),))
    else:
        raise SystemExit(f"unknown warm-up program {name!r}")
    f.lower(x).compile()


for name in filter(None, sys.argv[1].split(",")):
    warm_up(name)


def mlp_step(x, w1, w2):
    with tf.GradientTape() as tape:
        tape.watch([w1, w2])
        loss = tf.reduce_mean(tf.square(tf.nn.relu(x @ w1) @ w2))
    return (loss,) + tuple(tape.gradient(loss, [w1, w2]))


step = gt.function(mlp_step, mesh=mesh, in_shardings=(P("data"), P(None, "model"), P("model")))
run = step.lower(x, np.ones((16, 32), np.float32), np.ones((32, 16), np.float32)).compile()
print(json.dumps([[op, instance, list(groups)]
                  for _, op, instance, groups in run.collective_keys()]))
