"""Randomized differential tests: random small graphs, meshes and annotations.

Each example draws a mesh, input shapes (uneven dims included), specs for the inputs,
a chain of supported ops with an occasional gt.mesh_split hint, and checks that the
partitioned function equals single-device TF. More examples: GSPMD_TF_EXAMPLES=200, or
HYPOTHESIS_PROFILE=fuzz.
"""

import numpy as np
import tensorflow as tf
from hypothesis import given, strategies as st

import gspmd_tf as gt
from util import check_partitioned, specs

MESHES = [((8,), ("x",)), ((2, 4), ("data", "model")), ((4, 2), ("data", "model")),
          ((2, 2, 2), ("a", "b", "c"))]
DIMS = [1, 2, 3, 4, 5, 6, 8, 12]


UNARY = {"relu": tf.nn.relu, "tanh": tf.tanh, "gauss": lambda t: tf.exp(-t * t),
         "neg": tf.negative, "square": tf.square}


@st.composite
def programs(draw):
    shape_idx = draw(st.integers(0, len(MESHES) - 1))
    mesh_shape, axes = MESHES[shape_idx]
    rank = draw(st.integers(1, 3))
    shape = [draw(st.sampled_from(DIMS)) for _ in range(rank)]
    steps = draw(st.lists(st.sampled_from(
        ["unary", "add_other", "mul_bcast", "matmul", "reduce", "transpose", "reshape",
         "softmax", "concat", "hint", "slice"]), min_size=1, max_size=5))
    params = [draw(st.integers(0, 10 ** 6)) for _ in steps]
    in_spec = draw(specs(axes, rank))
    other_spec = draw(specs(axes, 2))
    hint_specs = [draw(specs(axes, 3)) for _ in steps]
    return mesh_shape, axes, tuple(shape), steps, params, in_spec, other_spec, hint_specs


def build(mesh, steps, params, hint_specs, shape, rng):
    """The traced function, and the extra inputs it reads (weights / other operands)."""
    extras = []
    plan = []
    cur = list(shape)
    for step, p, hint in zip(steps, params, hint_specs):
        r = np.random.default_rng(p)
        if step in ("matmul", "add_other") and cur:
            n = int(r.choice(DIMS))
            extra_shape = (cur[-1], n) if step == "matmul" else tuple(cur[-2:])
            extras.append(rng.standard_normal(extra_shape).astype(np.float32))
            plan.append((step, len(extras) - 1))
            if step == "matmul":
                cur[-1] = n
        elif step == "mul_bcast" and cur:
            plan.append((step, rng.standard_normal(cur[-1]).astype(np.float32)))
        elif step == "unary":
            plan.append((step, list(UNARY)[p % len(UNARY)]))
        elif step == "reduce" and len(cur) > 1:
            axis = p % len(cur)
            plan.append((step, (axis, ["sum", "max", "mean"][p % 3])))
            cur.pop(axis)
        elif step == "transpose" and len(cur) > 1:
            perm = list(r.permutation(len(cur)))
            plan.append((step, perm))
            cur = [cur[i] for i in perm]
        elif step == "reshape" and len(cur) > 1:
            plan.append((step, [cur[0] * cur[1]] + cur[2:]))
            cur = [cur[0] * cur[1]] + cur[2:]
        elif step == "softmax" and cur:
            plan.append((step, None))
        elif step == "concat" and cur:
            axis = p % len(cur)
            plan.append((step, axis))
            cur[axis] *= 2
        elif step == "slice" and cur and cur[0] > 1:
            plan.append((step, None))
            cur[0] -= 1
        elif step == "hint" and cur:
            spec = gt.P(*list(hint)[:len(cur)])
            plan.append((step, spec))

    def fn(x, *others):
        t = x
        for step, arg in plan:
            if step == "matmul":
                t = tf.tensordot(t, others[arg], 1) if len(t.shape) != 2 else t @ others[arg]
            elif step == "add_other":
                t = t + others[arg]
            elif step == "mul_bcast":
                t = t * tf.constant(arg)
            elif step == "unary":
                t = UNARY[arg](t)
            elif step == "reduce":
                axis, kind = arg
                t = {"sum": tf.reduce_sum, "max": tf.reduce_max, "mean": tf.reduce_mean}[kind](
                    t, axis)
            elif step == "transpose":
                t = tf.transpose(t, arg)
            elif step == "reshape":
                t = tf.reshape(t, arg)
            elif step == "softmax":
                t = tf.nn.softmax(t)
            elif step == "concat":
                t = tf.concat([t, t * 0.5], arg)
            elif step == "slice":
                t = t[1:]
            elif step == "hint":
                t = gt.mesh_split(t, mesh, arg)
        return t

    return fn, extras


@given(programs(), st.integers(0, 1000))
def test_random_graph_matches_single_device(program, seed):
    mesh_shape, axes, shape, steps, params, in_spec, other_spec, hint_specs = program
    mesh = gt.Mesh.create(mesh_shape, axes)
    rng = np.random.default_rng(seed)
    fn, extras = build(mesh, steps, params, hint_specs, shape, rng)
    x = rng.standard_normal(shape).astype(np.float32)
    in_shardings = (in_spec,) + tuple(
        gt.P(*list(other_spec)[:e.ndim]) for e in extras)
    check_partitioned(fn, (x, *extras), mesh, in_shardings)
