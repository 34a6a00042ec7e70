"""A fuzzer program as Python text: `source(program)` (what the worker executes),
`snippet(program)` (a standalone reproducer) and `describe(program)` (one line)."""

from __future__ import annotations

import os

import numpy as np

from gspmd_tf.testing.program_space import CONTROL_FLOW_FAMILIES, FAMILIES, FLOATS, loosest

def spec_source(entries):
    """P(...) for a list of spec entries."""
    if entries is None:
        return "None"
    parts = []
    for e in entries:
        parts.append(repr(e) if not isinstance(e, list) else repr(tuple(e)))
    return "P(" + ", ".join(parts) + ")"


def input_source(inp):
    """Lines creating one input as a numpy array."""
    name, shape, dtype = inp["name"], tuple(inp["shape"]), inp["dtype"]
    rng = f"np.random.default_rng({inp['seed']})"
    kind = inp["kind"]
    if kind == "normal":
        value = f"{rng}.standard_normal({shape})"
    elif kind == "index":
        low, high = inp["bound"]
        value = f"{rng}.integers({low}, {high}, {shape})"
    elif kind == "int32":
        value = f"{rng}.integers(-4, 5, {shape})"
    else:
        value = f"{rng}.integers(0, 2, {shape})"
    np_dtype = {"bool": "bool", "bfloat16": "tf.bfloat16.as_numpy_dtype"}.get(
        dtype, f"np.{dtype}")
    lines = [f"{name} = np.asarray({value}).astype({np_dtype})"]
    for what, flat in inp["special"]:
        index = tuple(int(i) for i in np.unravel_index(flat, shape))
        lines.append(f"{name}[{index}] = {'-np.inf' if what == '-inf' else 'np.' + what}")
    return lines


def watched(program):
    """The inputs a gradient program differentiates with respect to."""
    return [i["name"] for i in program["inputs"]
            if i["dtype"] in FLOATS and i["kind"] == "normal"]


def body_source(program):
    """The traced function `f` of a program."""
    names = [i["name"] for i in program["inputs"]]
    lines = [f"def f({', '.join(names)}):"]
    indent = "    "
    floats = watched(program)
    if program["grad"]:
        lines.append(f"    with tf.GradientTape() as tape:")
        lines.append(f"        tape.watch([{', '.join(floats)}])")
        indent = "        "
    for op in program["ops"]:
        lines.append(f"{indent}{op['out']} = " + op["expr"].format(*op["args"]))
        if op["hint"] is not None:
            lines.append(f"{indent}{op['out']} = gt.mesh_split({op['out']}, mesh, "
                         f"{spec_source(op['hint'])})")
    outs = program["outputs"]
    float_variables = [v["name"] for v in program.get("variables", ())
                       if v["dtype"] in FLOATS]
    if program["grad"]:
        ops = {op["out"]: op for op in program["ops"]}
        # A weighted sum with fixed weights in [0.5, 1.5): the gradient flowing into the
        # program is then exact (the weights), not a function of values that summation
        # order rounds differently (sin(t) had cos(t) there, which turns t's rounding
        # error eps*|t| into a relative error eps*|t*tan(t)| of every gradient); and
        # unlike a plain sum it is never constant (a plain sum of a softmax is 1, whose
        # gradient is rounding noise).
        losses = [f"tf.reduce_sum(tf.cast({o}, tf.float32) * np.random.default_rng({k})"
                  f".uniform(0.5, 1.5, {tuple(ops[o]['shape'])}).astype(np.float32))"
                  for k, o in enumerate(outs) if ops[o]["dtype"] in FLOATS]
        lines.append(f"{indent}loss = " + " + ".join(losses))
        lines.append(f"    grads = tape.gradient(loss, [{', '.join(floats + float_variables)}], "
                     "unconnected_gradients=tf.UnconnectedGradients.ZERO)")
        for k, name in enumerate(float_variables):
            lines.append(f"    g_{name} = tf.convert_to_tensor(grads[{len(floats) + k}])")
        if float_variables:
            lines.append(f"    grads = grads[:{len(floats)}]")
    lines += [f"    {line}" for line in map(update_source, program.get("updates", ()))]
    if program["grad"]:
        lines.append(f"    return [{', '.join(outs)}] + [tf.convert_to_tensor(g) for g in grads]")
    else:
        lines.append(f"    return [{', '.join(outs)}]")
    return lines


def update_source(update):
    """The statement of one variable update (see Generator.update)."""
    v, kind, arg = update["variable"], update["kind"], update["arg"]
    if kind == "sgd":
        return f"{v}.assign_sub(0.1 * g_{v})"
    if kind == "apply":
        return (f"tf.raw_ops.ResourceApplyGradientDescent(var={v}.handle, "
                f"alpha=tf.constant(0.1, {v}.dtype), delta=g_{v})")
    return f"{v}.{kind}({arg})"


def variable_source(variable):
    """The line creating one variable by `make_variable(initial value, spec, name)`: a
    tf.Variable for the single-device run, a gt.Variable for the partitioned one."""
    shape, rng = tuple(variable["shape"]), f"np.random.default_rng({variable['seed']})"
    value = (f"{rng}.integers(-4, 5, {shape})" if variable["dtype"] == "int32"
             else f"{rng}.standard_normal({shape})")
    return (f"{variable['name']} = make_variable(np.asarray({value}).astype(np."
            f"{variable['dtype']}), {spec_source(variable['spec'])}, {variable['name']!r})")


def output_precisions(program):
    """Per output of f (gradients included), the float type whose tolerance applies
    (None: compare exactly)."""
    by_name = {op["out"]: op.get("precision") for op in program["ops"]}
    by_name.update({i["name"]: i["dtype"] if i["dtype"] in FLOATS else None
                    for i in program["inputs"]})
    result = [by_name[o] for o in program["outputs"]]
    if program["grad"]:
        every = loosest(list(by_name.values()) + ["float32"])  # the loss is float32
        result += [every] * len(watched(program))
    return result


def source(program):
    """Python text defining mesh, the inputs, f, args, in_shardings and out_shardings
    (expects np, tf, gt and P in scope)."""
    mesh = program["mesh"]
    lines = [f"mesh = gt.Mesh.create({tuple(mesh['shape'])}, {tuple(mesh['axes'])})"]
    for inp in program["inputs"]:
        lines += input_source(inp)
    lines += [variable_source(v) for v in program.get("variables", ())]
    lines += body_source(program)
    names = [i["name"] for i in program["inputs"]]
    lines.append(f"args = ({''.join(n + ', ' for n in names)})")
    lines.append("in_shardings = (" + "".join(
        spec_source(i["spec"]) + ", " for i in program["inputs"]) + ")")
    outs = program["out_shardings"]
    if outs is not None and program["grad"]:
        outs = outs + [None] * len(watched(program))
    lines.append("out_shardings = None" if outs is None else
                 "out_shardings = [" + ", ".join(spec_source(s) for s in outs) + "]")
    return "\n".join(lines) + "\n"


SNIPPET_HEAD = """\
import os
os.environ.setdefault("GSPMD_TF_COLLECTIVE_TIMEOUT", "20")
import numpy as np
import tensorflow as tf
import gspmd_tf as gt
from gspmd_tf import P
gt.configure_cpu_devices(8)
"""

SNIPPET_TAIL = """\
want = f(*[tf.convert_to_tensor(a) for a in args])  # single-device TF, eagerly
got = gt.function(f, mesh=mesh, in_shardings=in_shardings, out_shardings=out_shardings)(*args)
for i, (g, w) in enumerate(zip(got, want)):
    print(i, "max abs diff:", np.max(np.abs(g.numpy().astype(np.float64) - np.asarray(w, np.float64)), initial=0))
"""


VARIABLE_SNIPPET_TAIL = """\
got = gt.function(f, mesh=mesh, in_shardings=in_shardings, out_shardings=out_shardings)
got = [got(*args) for call in range(2)]  # the second call sees the updated variables
for name in variables:
    print(name, "max abs diff:", np.max(np.abs(globals()[name].numpy().astype(np.float64) - want_variables[name]), initial=0))
for call in range(2):
    for i, (g, w) in enumerate(zip(got[call], want[call])):
        print("call", call, i, "max abs diff:", np.max(np.abs(g.numpy().astype(np.float64) - np.asarray(w, np.float64)), initial=0))
"""


def snippet(program):
    """A standalone reproducer: runs the program partitioned (on the GSPMD_TF_BACKEND
    this process has, if any) and on one device."""
    head = SNIPPET_HEAD
    if os.environ.get("GSPMD_TF_BACKEND"):
        head = head.replace("import numpy", "os.environ.setdefault(\"GSPMD_TF_BACKEND\", "
                            f"{os.environ['GSPMD_TF_BACKEND']!r})\nimport numpy", 1)
    if not program.get("variables"):
        return head + source(program) + SNIPPET_TAIL
    # the same source twice: with tf.Variables for single-device TF, then gt.Variables
    names = [v["name"] for v in program["variables"]]
    return (head + f"variables = {names}\n"
            "make_variable = lambda value, spec, name: tf.Variable(value, name=name)\n"
            + source(program)
            + "want = [f(*[tf.convert_to_tensor(a) for a in args]) for call in range(2)]\n"
            "want_variables = {name: globals()[name].numpy().astype(np.float64) "
            "for name in variables}\n"
            "make_variable = lambda value, spec, name: gt.Variable(value, mesh, spec, "
            "name=name)\n" + source(program) + VARIABLE_SNIPPET_TAIL)


def describe(program):
    """One line: mesh, op families, inputs."""
    ops = ",".join(op["family"] for op in program["ops"])
    return (f"mesh={tuple(program['mesh']['shape'])} ops=[{ops}] "
            f"inputs={len(program['inputs'])}{' grad' if program['grad'] else ''}")


def all_families():
    """Every op family the generator knows."""
    return list(FAMILIES) + list(CONTROL_FLOW_FAMILIES)
