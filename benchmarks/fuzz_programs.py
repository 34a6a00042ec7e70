"""Random programs for the differential fuzzer (benchmarks/fuzz.py): generation and source.

A program is plain data (JSON-able): a mesh, inputs (shape, dtype, value recipe, spec), a
list of ops (each a Python expression over earlier tensors, its result shape and dtype,
an optional gt.mesh_split hint), the outputs, optional out_shardings and an optional
gradient. `source(program)` renders it as Python; the fuzzer's worker executes exactly
that text, and `snippet(program)` wraps it into a standalone reproducer, so a reported
program is the program that ran.

This module needs only numpy (the driver process never imports TensorFlow).
"""

from __future__ import annotations

import math
import os

import numpy as np

MESHES = [(8,), (4,), (2,), (1,), (2, 4), (4, 2), (1, 8), (8, 1), (2, 2), (2, 2, 2),
          (1, 2, 4), (2, 1, 4), (4, 1, 2), (2, 4, 1), (1, 1, 8)]
AXIS_NAMES = [("x", "y", "z"), ("data", "model", "pipe"), ("a", "b", "c")]
DIMS = [1, 2, 3, 4, 5, 6, 7, 8, 12]
MAX_ELEMENTS = 384
FLOATS = ("float32", "float64", "float16", "bfloat16")
HALF = ("float16", "bfloat16")

# Op families (weights: how often each is drawn among the applicable ones).
FAMILIES = {
    "unary": 10, "binary": 10, "reshape": 8, "expand_squeeze": 3, "transpose": 5,
    "slice": 4, "strided_slice": 6, "pad": 4, "concat": 4, "tile": 3, "gather": 5,
    "one_hot": 2, "reduce": 8, "arg_reduce": 3, "softmax": 3, "cross_entropy": 2,
    "einsum": 5, "matmul": 5, "bias_add": 3, "conv": 4, "pool": 3, "segment": 3,
    "select": 3, "cast": 3, "add_n": 1, "broadcast": 2, "no_rule": 2,
}
# Families drawn only by control-flow programs (a fraction --control_flow_prob of them,
# decided by a random stream of their own, so every other program of a seed stays the
# same as before these families existed).
CONTROL_FLOW_FAMILIES = {"roll": 12, "while": 15, "cond": 12}

# Shape-preserving steps of while bodies and cond branches ({v}: the value stepped). They
# keep values bounded over a few iterations and make no NaN/Inf of finite values.
BODY_UNARY = ["tf.tanh({v})", "tf.sin({v})", "tf.nn.relu({v})", "tf.negative({v})",
              "tf.abs({v})", "tf.sigmoid({v})", "{v} * 0.5"]
BODY_BINARY = ["tf.add", "tf.subtract", "tf.maximum", "tf.minimum"]

# Elementwise ops by dtype class. "ill" ops amplify rounding differences (division by a
# small value, discontinuities): they are not applied to tensors whose value depends on
# summation order, since a partitioned sum legitimately rounds differently.
UNARY_FLOAT = ["tf.nn.relu", "tf.tanh", "tf.exp", "tf.sigmoid", "tf.negative", "tf.square",
               "tf.abs", "tf.nn.elu", "tf.nn.softplus", "tf.nn.relu6", "tf.nn.leaky_relu",
               "tf.sin", "tf.zeros_like", "tf.ones_like", "tf.identity", "tf.stop_gradient",
               "tf.math.is_nan", "tf.math.is_finite", "tf.math.is_inf"]
UNARY_FLOAT_ILL = ["tf.math.log1p", "tf.sqrt", "tf.math.reciprocal", "tf.math.floor",
                   "tf.math.sign", "tf.math.round", "tf.math.rsqrt"]
UNARY_INT = ["tf.negative", "tf.abs", "tf.square", "tf.math.sign", "tf.identity",
             "tf.zeros_like"]
UNARY_BOOL = ["tf.math.logical_not", "tf.identity"]
BINARY_FLOAT = ["tf.add", "tf.subtract", "tf.multiply", "tf.maximum", "tf.minimum",
                "tf.math.squared_difference"]
BINARY_FLOAT_ILL = ["tf.divide", "tf.math.divide_no_nan", "tf.equal", "tf.less",
                    "tf.greater_equal", "tf.math.floormod"]
BINARY_INT = ["tf.add", "tf.subtract", "tf.multiply", "tf.maximum", "tf.minimum",
              "tf.equal", "tf.less", "tf.greater_equal"]
BINARY_BOOL = ["tf.math.logical_and", "tf.math.logical_or", "tf.equal",
               "tf.math.logical_xor"]
BOOL_RESULT = {"tf.math.is_nan", "tf.math.is_finite", "tf.math.is_inf", "tf.equal",
               "tf.less", "tf.greater_equal"}
# the ops that may turn finite values into NaN/Inf
NONFINITE_MAKERS = {"tf.exp", "tf.math.log1p", "tf.sqrt", "tf.math.reciprocal",
                    "tf.math.rsqrt", "tf.divide", "tf.math.floormod", "tf.square",
                    "tf.multiply", "tf.math.squared_difference"}


def loosest(dtypes):
    """The least precise of some dtypes (non-float ones ignored; None if none)."""
    floats = [d for d in dtypes if d in FLOATS]
    return max(floats, key=lambda d: PRECISION_RANK[d]) if floats else None


PRECISION_RANK = {"float64": 0, "float32": 1, "float16": 2, "bfloat16": 3}


class Tensor:
    """What the generator knows of one tensor of the program being built."""

    def __init__(self, name, shape, dtype, rounded=False, nonfinite=False, precision=None):
        self.name = name
        self.shape = list(shape)
        self.dtype = dtype
        self.rounded = rounded      # value depends on summation order
        self.nonfinite = nonfinite  # may hold NaN/Inf
        # the least precise float type the value went through (decides the tolerance)
        self.precision = loosest([precision, dtype])

    @property
    def rank(self):
        return len(self.shape)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def is_float(self):
        return self.dtype in FLOATS


class Generator:
    """Builds one random program from a numpy Generator."""

    def __init__(self, rng, num_ops, families=None, grad_prob=0.15, meshes=None,
                 zero_prob=0.04, variables=False, volumes=False, control_flow=False):
        self.rng = rng
        self.volumes = volumes  # the conv and pool families draw 3-D ops (op_conv3d...)
        self.with_variables = variables  # read and update gt.Variables (see new_variable)
        self.variables = []
        self.zero_prob = zero_prob  # chance of a 0 in each drawn dim
        self.num_ops = num_ops
        self.families = {k: v for k, v in FAMILIES.items()
                         if families is None or k in families}
        if control_flow:  # roll, while, cond (see CONTROL_FLOW_FAMILIES)
            self.families.update({k: v for k, v in CONTROL_FLOW_FAMILIES.items()
                                  if families is None or k in families})
        self.grad = rng.random() < grad_prob
        meshes = meshes or MESHES
        shape = meshes[rng.integers(len(meshes))]
        names = AXIS_NAMES[rng.integers(len(AXIS_NAMES))][:len(shape)]
        self.mesh = {"shape": list(shape), "axes": list(names)}
        self.inputs = []
        self.ops = []
        self.tensors = []
        self.used = set()

    # ------------------------------------------------------------------ helpers
    def chance(self, p):
        return self.rng.random() < p

    def pick(self, seq):
        return seq[self.rng.integers(len(seq))]

    def dim(self):
        if self.chance(self.zero_prob):
            return 0
        return int(self.pick(DIMS))

    def shape(self, rank=None):
        rank = int(self.rng.integers(1, 4)) if rank is None else rank
        for _ in range(20):
            shape = [self.dim() for _ in range(rank)]
            if np.prod(shape) <= MAX_ELEMENTS:
                return shape
        return [1] * rank

    def float_dtype(self):
        r = self.rng.random()
        return "float32" if r < 0.8 else "float64" if r < 0.88 else "float16" if r < 0.94 \
            else "bfloat16"

    def any_dtype(self):
        r = self.rng.random()
        return self.float_dtype() if r < 0.85 else "int32" if r < 0.95 else "bool"

    def spec(self, rank):
        """A random PartitionSpec (list of entries) over the mesh: each axis once."""
        free = list(self.mesh["axes"])
        self.rng.shuffle(free)
        entries = []
        for _ in range(rank):
            r = self.rng.random()
            if r < 0.45 or not free:
                entries.append(None)
            elif r < 0.85 or len(free) < 2:
                entries.append(free.pop())
            else:
                entries.append([free.pop(), free.pop()])
        while entries and entries[-1] is None and self.chance(0.5):
            entries.pop()
        return entries

    def new_input(self, shape, dtype, kind=None, bound=None, specials=True):
        """A fresh program argument with a random spec (and NaN/Inf for some floats)."""
        name = f"x{len(self.inputs)}"
        kind = kind or ("normal" if dtype in FLOATS else dtype)
        special = []
        size = int(np.prod(shape, dtype=np.int64))
        if kind == "normal" and specials and size and self.chance(0.2):
            for _ in range(int(self.rng.integers(1, 4))):
                special.append([self.pick(["nan", "inf", "-inf"]),
                                int(self.rng.integers(size))])
        self.inputs.append({"name": name, "shape": list(shape), "dtype": dtype, "kind": kind,
                            "bound": bound, "seed": int(self.rng.integers(2 ** 31)),
                            "special": special, "spec": self.spec(len(shape))})
        t = Tensor(name, shape, dtype, nonfinite=bool(special))
        if kind not in ("index", "labels"):
            self.tensors.append(t)
        return t

    def operand(self, pred=lambda t: True, make=None):
        """An existing tensor satisfying `pred` (recent ones favoured) or `make()`."""
        cands = [t for t in self.tensors if pred(t)]
        if cands and (make is None or self.chance(0.85)):
            weights = np.array([2.0 ** min(i, 30) for i in range(len(cands))])
            t = cands[self.rng.choice(len(cands), p=weights / weights.sum())]
            return t
        return make() if make is not None else None

    def float_operand(self, rank=None, min_rank=0):
        def ok(t):
            return t.is_float and t.rank >= min_rank and (rank is None or t.rank == rank)
        r = rank if rank is not None else int(self.rng.integers(max(min_rank, 1), 4))
        return self.operand(ok, lambda: self.new_input(self.shape(r), self.float_dtype()))

    def emit(self, expr, args, shape, dtype, rounded=False, nonfinite=None, family="",
             variants=None):
        """Append an op; its result becomes a tensor of the program. variants: simpler
        forms of the op ({"expr", "args", "shape"}) for the shrinker to try."""
        name = f"t{len(self.ops)}"
        if nonfinite is None:
            nonfinite = any(a.nonfinite for a in args)
        hint = None
        if self.chance(0.15) and shape:
            hint = self.spec(len(shape))
        precision = loosest([a.precision for a in args] + [dtype])
        self.ops.append({"out": name, "expr": expr, "args": [a.name for a in args],
                         "shape": list(shape), "dtype": dtype, "family": family,
                         "hint": hint, "precision": precision})
        if variants:
            self.ops[-1]["variants"] = variants
        self.used.update(a.name for a in args)
        t = Tensor(name, shape, dtype, rounded or any(a.rounded for a in args), nonfinite,
                   precision)
        self.tensors.append(t)
        return t

    # ------------------------------------------------------------------ the program
    def program(self):
        if self.with_variables:
            for _ in range(int(self.rng.integers(1, 3))):
                self.new_variable()
        for _ in range(50 * self.num_ops):
            if len(self.ops) >= self.num_ops:
                break
            names = list(self.families)
            weights = np.array([self.families[n] for n in names], float)
            family = names[self.rng.choice(len(names), p=weights / weights.sum())]
            getattr(self, "op_" + family)()
        if not self.ops:
            self.op_unary()
        float_inputs = [i["name"] for i in self.inputs
                        if i["dtype"] in FLOATS and i["kind"] == "normal"]
        float_variables = [v for v in self.variables if v["dtype"] in FLOATS]
        grad = self.grad and bool(float_inputs or float_variables)
        updates = [self.update(v, grad) for v in self.variables if self.chance(0.8)]
        last = self.ops[-1]["out"]
        unused = [op["out"] for op in self.ops[:-1] if op["out"] not in self.used]
        outputs = [last] + unused  # every result is used: no dead code
        by_name = {t.name: t for t in self.tensors}
        out_shardings = None
        if self.chance(0.3):
            out_shardings = [self.spec(by_name[n].rank) if self.chance(0.7) else None
                             for n in outputs]
        grad = grad and any(by_name[n].is_float for n in outputs)
        program = {"mesh": self.mesh, "inputs": self.inputs, "ops": self.ops,
                   "outputs": outputs, "out_shardings": out_shardings, "grad": grad}
        if self.with_variables:
            program["variables"] = self.variables
            program["updates"] = [u for u in updates if grad or u["arg"]]  # steps need grad
        return program

    # ------------------------------------------------------------------ variables
    def new_variable(self):
        """A gt.Variable (tf.Variable on one device) of random shape, dtype and spec,
        read inside f by a first op."""
        name = f"v{len(self.variables)}"
        shape = self.shape()
        dtype = self.pick(["float32"] * 6 + ["float64", "int32"])
        self.variables.append({"name": name, "shape": shape, "dtype": dtype,
                               "seed": int(self.rng.integers(2 ** 31)),
                               "spec": self.spec(len(shape))})
        read = self.pick([f"tf.convert_to_tensor({name})", f"{name}.read_value()",
                          f"tf.identity({name})"])
        # its value after an update depends on summation order and may be NaN/Inf
        self.emit(read, [], shape, dtype, rounded=True, nonfinite=True, family="variable")

    def update(self, variable, grad):
        """An update of `variable` at the end of f: assign/assign_add/assign_sub of a
        program tensor of its shape and dtype, or (float, with a gradient) a gradient
        step by assign_sub or by the fused ResourceApplyGradientDescent."""
        kinds = ["assign", "assign_add", "assign_sub"]
        if grad and variable["dtype"] in FLOATS:
            kinds += ["sgd", "apply"] * 2
        kind = self.pick(kinds)
        arg = None
        if kind not in ("sgd", "apply"):
            same = [t for t in self.tensors
                    if t.shape == variable["shape"] and t.dtype == variable["dtype"]]
            t = self.pick(same) if same and self.chance(0.7) else \
                self.new_input(variable["shape"], variable["dtype"])
            self.used.add(t.name)
            arg = t.name
        return {"variable": variable["name"], "kind": kind, "arg": arg}

    # ------------------------------------------------------------------ op families
    def op_unary(self):
        x = self.operand(make=lambda: self.new_input(self.shape(), self.any_dtype()))
        if x.is_float:
            fns = UNARY_FLOAT + ([] if x.rounded else UNARY_FLOAT_ILL)
        else:
            fns = UNARY_BOOL if x.dtype == "bool" else UNARY_INT
        fn = self.pick(fns)
        dtype = "bool" if fn in BOOL_RESULT else x.dtype
        self.emit(f"{fn}({{0}})", [x], x.shape, dtype, family="unary",
                  nonfinite=x.nonfinite or fn in NONFINITE_MAKERS)

    def broadcast_partner(self, x):
        """A shape that broadcasts with x's (a suffix of it, some dims 1, maybe a leading
        1) and the broadcast result shape."""
        k = int(self.rng.integers(0, x.rank + 1)) if self.chance(0.4) else x.rank
        shape = list(x.shape[x.rank - k:])
        for d in range(len(shape)):
            if self.chance(0.2):
                shape[d] = 1
        if self.chance(0.3):
            shape = [1] * int(self.rng.integers(0, 2)) + shape
        out = list(x.shape)
        full = [1] * (len(shape) - len(out)) + out
        other = [1] * (len(full) - len(shape)) + shape
        result = [max(a, b) if 0 not in (a, b) else 0 for a, b in zip(full, other)]
        if np.prod(result) > MAX_ELEMENTS:
            return x.shape, x.shape
        return shape, result

    def op_binary(self):
        x = self.operand(make=lambda: self.new_input(self.shape(), self.any_dtype()))
        if x.is_float:
            fns = BINARY_FLOAT + ([] if x.rounded else BINARY_FLOAT_ILL)
        else:
            fns = BINARY_BOOL if x.dtype == "bool" else BINARY_INT
        fn = self.pick(fns)
        same = [t for t in self.tensors if t.dtype == x.dtype and t.shape == x.shape
                and t is not x and not (t.rounded and fn in BINARY_FLOAT_ILL)]
        if same and self.chance(0.4):
            y, out = self.pick(same), x.shape
        else:
            shape, out = self.broadcast_partner(x)
            y = self.new_input(shape, x.dtype)
        if self.chance(0.5):
            x, y = y, x
        if fn in ("tf.divide", "tf.math.floormod", "tf.math.divide_no_nan") and y.rounded:
            x, y = y, x
        dtype = "bool" if fn in BOOL_RESULT else x.dtype
        self.emit(f"{fn}({{0}}, {{1}})", [x, y], out, dtype, family="binary",
                  nonfinite=x.nonfinite or y.nonfinite or fn in NONFINITE_MAKERS)

    def op_add_n(self):
        x = self.operand(lambda t: t.dtype in ("float32", "float64", "int32"))
        if x is None:
            return
        others = [t for t in self.tensors if t.dtype == x.dtype and t.shape == x.shape]
        args = [x] + [self.pick(others) for _ in range(int(self.rng.integers(1, 3)))]
        self.emit("tf.add_n([" + ", ".join(f"{{{i}}}" for i in range(len(args))) + "])",
                  args, x.shape, x.dtype, family="add_n")

    def random_factorization(self, size, rank):
        """A random shape of `rank` dims with product `size` (> 0)."""
        primes = []
        n, p = size, 2
        while n > 1:
            while n % p == 0:
                primes.append(p)
                n //= p
            p += 1
        shape = [1] * rank
        for q in primes:
            shape[self.rng.integers(rank)] *= q
        return shape

    def op_reshape(self):
        x = self.operand(make=lambda: self.new_input(self.shape(), self.any_dtype()))
        rank = int(self.rng.integers(1, 5))
        if x.size == 0:
            shape = [self.pick([1, 2, 3, 4]) for _ in range(rank)]
            shape[self.rng.integers(rank)] = 0
        else:
            shape = self.random_factorization(x.size, rank)
        target = list(shape)
        if x.size and self.chance(0.25):
            target[self.rng.integers(rank)] = -1
        self.emit(f"tf.reshape({{0}}, {target})", [x], shape, x.dtype, family="reshape")

    def op_expand_squeeze(self):
        x = self.operand(make=lambda: self.new_input(self.shape(), self.any_dtype()))
        ones = [d for d, n in enumerate(x.shape) if n == 1]
        if ones and self.chance(0.6):
            if self.chance(0.5):
                d = self.pick(ones)
                shape = x.shape[:d] + x.shape[d + 1:]
                self.emit(f"tf.squeeze({{0}}, axis={d})", [x], shape, x.dtype,
                          family="expand_squeeze")
            else:
                shape = [n for n in x.shape if n != 1]
                self.emit("tf.squeeze({0})", [x], shape, x.dtype, family="expand_squeeze")
            return
        axis = int(self.rng.integers(-x.rank - 1, x.rank + 1))
        pos = axis if axis >= 0 else x.rank + 1 + axis
        shape = x.shape[:pos] + [1] + x.shape[pos:]
        self.emit(f"tf.expand_dims({{0}}, {axis})", [x], shape, x.dtype,
                  family="expand_squeeze")

    def op_transpose(self):
        x = self.operand(lambda t: t.rank >= 2,
                         lambda: self.new_input(self.shape(int(self.rng.integers(2, 4))),
                                                self.any_dtype()))
        perm = [int(p) for p in self.rng.permutation(x.rank)]
        self.emit(f"tf.transpose({{0}}, {perm})", [x], [x.shape[p] for p in perm], x.dtype,
                  family="transpose")

    def op_slice(self):
        x = self.operand(lambda t: t.rank >= 1)
        if x is None:
            x = self.new_input(self.shape(), self.any_dtype())
        begin, size, shape = [], [], []
        for n in x.shape:
            b = int(self.rng.integers(0, n + 1))
            if self.chance(0.3):
                s, out = -1, n - b
            else:
                s = out = int(self.rng.integers(0, n - b + 1))
            begin.append(b)
            size.append(s)
            shape.append(out)
        self.emit(f"tf.slice({{0}}, {begin}, {size})", [x], shape, x.dtype, family="slice")

    def op_strided_slice(self):
        x = self.operand(lambda t: t.rank >= 1)
        if x is None:
            x = self.new_input(self.shape(), self.any_dtype())
        items, shape = [], []
        for n in x.shape:
            r = self.rng.random()
            if r < 0.15 and n > 0:
                items.append(str(int(self.rng.integers(-n, n))))  # shrinks the dim
                continue
            if r < 0.3:
                items.append(":")
                shape.append(n)
                continue
            start = self.pick([None, int(self.rng.integers(-n - 1, n + 2))])
            stop = self.pick([None, int(self.rng.integers(-n - 1, n + 2))])
            step = self.pick([None, 1, 2, 3, -1, -2])
            items.append(":".join("" if v is None else str(v) for v in (start, stop, step)))
            shape.append(len(range(*slice(start, stop, step).indices(n))))
        if self.chance(0.1):
            pos = int(self.rng.integers(0, len(items) + 1))
            items.insert(pos, "tf.newaxis")
            shape.insert(pos - sum(1 for i in items[:pos] if _is_index(i)), 1)
        if self.chance(0.1) and len(items) > 1:
            # an ellipsis standing for the leading dims
            k = int(self.rng.integers(1, len(items)))
            dropped = [i for i in items[:k]]
            if all(i == ":" for i in dropped) and "tf.newaxis" not in items:
                items = ["..."] + items[k:]
        self.emit("{0}[" + ", ".join(items) + "]", [x], shape, x.dtype,
                  family="strided_slice")

    def op_pad(self):
        x = self.operand(lambda t: t.rank >= 1 and t.dtype != "bool")
        if x is None:
            x = self.new_input(self.shape(), self.float_dtype())
        mode = "CONSTANT" if self.chance(0.75) else self.pick(["REFLECT", "SYMMETRIC"])
        if 0 in x.shape:  # TF's mirror pads need every dim non-empty
            mode = "CONSTANT"
        pads = []
        for n in x.shape:
            limit = 3 if mode == "CONSTANT" else (n - 1 if mode == "REFLECT" else n)
            limit = max(0, min(limit, 3))
            pads.append([int(self.rng.integers(0, limit + 1)) for _ in range(2)])
        shape = [n + a + b for n, (a, b) in zip(x.shape, pads)]
        if np.prod(shape) > MAX_ELEMENTS:
            return
        if mode == "CONSTANT":
            value = self.pick([0, 1, -2])
            expr = f"tf.pad({{0}}, {pads}, constant_values={value})"
        else:
            expr = f"tf.pad({{0}}, {pads}, mode={mode!r})"
        self.emit(expr, [x], shape, x.dtype, family="pad")

    def op_concat(self):
        x = self.operand(lambda t: t.rank >= 1)
        if x is None:
            x = self.new_input(self.shape(), self.any_dtype())
        axis = int(self.rng.integers(-x.rank, x.rank))
        d = axis % x.rank
        args = [x]
        for _ in range(int(self.rng.integers(1, 3))):
            if self.chance(0.3):
                args.append(x)
            else:
                shape = list(x.shape)
                shape[d] = self.dim() if self.chance(0.3) else self.pick([1, 2, 3, 5, 8])
                args.append(self.new_input(shape, x.dtype))
        shape = list(x.shape)
        shape[d] = sum(a.shape[d] for a in args)
        if np.prod(shape) > MAX_ELEMENTS:
            return
        self.emit("tf.concat([" + ", ".join(f"{{{i}}}" for i in range(len(args))) +
                  f"], axis={axis})", args, shape, x.dtype, family="concat")

    def op_tile(self):
        x = self.operand(lambda t: t.rank >= 1 and t.size <= 64)
        if x is None:
            return
        mult = [self.pick([1, 1, 2, 3]) for _ in x.shape]
        shape = [n * m for n, m in zip(x.shape, mult)]
        if np.prod(shape) > MAX_ELEMENTS:
            return
        self.emit(f"tf.tile({{0}}, {mult})", [x], shape, x.dtype, family="tile")

    def index_input(self, shape, bound, low=0):
        """An int32 input with values in [low, bound)."""
        if bound <= low:
            shape = list(shape) + [0] if not shape or 0 not in shape else shape
            if not shape:
                shape = [0]
            bound = low + 1
        return self.new_input(shape, "int32", kind="index", bound=[low, bound])

    def op_gather(self):
        x = self.operand(lambda t: t.rank >= 1)
        if x is None:
            x = self.new_input(self.shape(), self.any_dtype())
        axis = int(self.rng.integers(-x.rank, x.rank))
        d = axis % x.rank
        ishape = self.shape(int(self.rng.integers(0, 3)))
        idx = self.index_input(ishape, x.shape[d])
        shape = x.shape[:d] + idx.shape + x.shape[d + 1:]
        if np.prod(shape) > MAX_ELEMENTS:
            return
        self.emit(f"tf.gather({{0}}, {{1}}, axis={axis})", [x, idx], shape, x.dtype,
                  family="gather")

    def op_one_hot(self):
        depth = 0 if self.chance(self.zero_prob) else int(self.pick([1, 2, 3, 5, 8]))
        ishape = self.shape(int(self.rng.integers(0, 3)))
        idx = self.index_input(ishape, depth + 1, low=-1)  # -1 and depth: all-off rows
        axis = int(self.rng.integers(-1, len(idx.shape) + 1))
        pos = len(idx.shape) if axis == -1 else axis
        shape = idx.shape[:pos] + [depth] + idx.shape[pos:]
        if np.prod(shape) > MAX_ELEMENTS:
            return
        dtype = self.pick(["float32", "float32", "int32", "float64"])
        self.emit(f"tf.one_hot({{0}}, {depth}, on_value=3, off_value=-1, axis={axis}, "
                  f"dtype=tf.{dtype})", [idx], shape, dtype, family="one_hot")

    def op_reduce(self):
        x = self.operand(make=lambda: self.new_input(self.shape(), self.any_dtype()))
        if x.dtype == "bool":
            fn = self.pick(["tf.reduce_all", "tf.reduce_any"])
        else:
            fn = self.pick(["tf.reduce_sum", "tf.reduce_mean", "tf.reduce_max",
                            "tf.reduce_min", "tf.reduce_prod"])
        r = self.rng.random()
        if r < 0.15 or x.rank == 0:
            axes = None
        elif r < 0.6:
            axes = int(self.rng.integers(-x.rank, x.rank))
        else:
            k = int(self.rng.integers(1, x.rank + 1))
            axes = sorted(int(a) for a in self.rng.choice(x.rank, k, replace=False))
        keep = self.chance(0.3)
        reduced = set(range(x.rank)) if axes is None else \
            {a % x.rank for a in np.atleast_1d(axes)}
        shape = [1 if d in reduced else n for d, n in enumerate(x.shape)
                 if keep or d not in reduced]
        rounded = fn in ("tf.reduce_sum", "tf.reduce_mean", "tf.reduce_prod") and x.is_float
        self.emit(f"{fn}({{0}}, axis={axes}, keepdims={keep})", [x], shape, x.dtype,
                  rounded=rounded, nonfinite=x.nonfinite or fn == "tf.reduce_prod"
                  or (fn == "tf.reduce_mean" and 0 in x.shape) or x.dtype in HALF,
                  family="reduce")

    def op_arg_reduce(self):
        x = self.operand(lambda t: t.rank >= 1 and t.dtype != "bool" and not t.rounded
                         and 0 not in t.shape)
        if x is None:
            return
        fn = self.pick(["tf.argmax", "tf.argmin"])
        axis = int(self.rng.integers(-x.rank, x.rank))
        out_type = self.pick(["int32", "int64"])
        shape = [n for d, n in enumerate(x.shape) if d != axis % x.rank]
        self.emit(f"{fn}({{0}}, axis={axis}, output_type=tf.{out_type})", [x], shape,
                  out_type, family="arg_reduce")

    def op_softmax(self):
        fn = self.pick(["tf.nn.softmax", "tf.nn.log_softmax"])
        # TF's float32/bfloat16 softmax (oneDNN) puts NaN in lane-dependent places of a row
        # holding NaN/+Inf ([0..14, nan] -> NaN at 0 and 15, 0 elsewhere; [0..15, nan] ->
        # NaN at 15 and 16): no defined value to compare with. Its float16/float64 kernel
        # (Eigen) makes such rows NaN, as gspmd-tf does on a split row.
        lanes = fn == "tf.nn.softmax"
        x = self.operand(lambda t: t.is_float and t.rank >= 1 and not (
            lanes and t.nonfinite and t.dtype in ("float32", "bfloat16")),
            lambda: self.new_input(self.shape(int(self.rng.integers(1, 4))),
                                   self.float_dtype(), specials=not lanes))
        axis = -1 if self.chance(0.7) else int(self.rng.integers(-x.rank, x.rank))
        self.emit(f"{fn}({{0}}, axis={axis})", [x], x.shape, x.dtype, rounded=True,
                  nonfinite=x.nonfinite or fn == "tf.nn.log_softmax" or x.dtype in HALF,
                  family="softmax")

    def op_cross_entropy(self):
        logits = self.operand(lambda t: t.rank == 2 and t.dtype in ("float32", "float64")
                              and t.shape[1] > 0,
                              lambda: self.new_input([self.dim(), self.pick(DIMS)],
                                                     self.pick(["float32", "float64"])))
        b, c = logits.shape
        if self.chance(0.5):
            labels = self.index_input([b], c)
            expr = "tf.nn.sparse_softmax_cross_entropy_with_logits(labels={1}, logits={0})"
        else:
            labels = self.new_input([b, c], logits.dtype, specials=False)
            expr = "tf.nn.softmax_cross_entropy_with_logits(labels={1}, logits={0})"
        self.emit(expr, [logits, labels], [b], logits.dtype, rounded=True,
                  nonfinite=True, family="cross_entropy")

    def op_einsum(self):
        x = self.float_operand(min_rank=1)
        letters = iter("abcdefghij")
        xl = []
        for d, n in enumerate(x.shape):
            same = [xl[e] for e in range(d) if x.shape[e] == n]
            xl.append(same[0] if same and self.chance(0.1) else next(letters))
        sizes = dict(zip(xl, x.shape))
        terms, args = ["".join(xl)], [x]
        if self.chance(0.75):
            yl = [l for l in dict.fromkeys(xl) if self.chance(0.6)]
            for _ in range(int(self.rng.integers(0, 3))):
                l = next(letters)
                sizes[l] = self.pick([1, 2, 3, 4])
                yl.append(l)
            yl = [yl[i] for i in self.rng.permutation(len(yl))]
            y = self.new_input([sizes[l] for l in yl], x.dtype)
            terms.append("".join(yl))
            args.append(y)
        union = list(dict.fromkeys("".join(terms)))
        out = [l for l in union if self.chance(0.6)]
        out = [out[i] for i in self.rng.permutation(len(out))]
        shape = [sizes[l] for l in out]
        if np.prod(shape) > MAX_ELEMENTS or math.prod(sizes.values()) > 20000:
            return
        eq = ",".join(terms) + "->" + "".join(out)
        self.emit(f"tf.einsum({eq!r}, " + ", ".join(f"{{{i}}}" for i in range(len(args)))
                  + ")", args, shape, x.dtype, rounded=True, family="einsum")

    def op_matmul(self):
        x = self.operand(lambda t: t.rank in (2, 3, 4) and t.dtype in ("float32", "float64",
                                                                      "int32", "bfloat16")
                         and not (t.dtype == "int32" and t.rank == 2),
                         lambda: self.new_input(self.shape(int(self.rng.integers(2, 4))),
                                                self.float_dtype()))
        ta, tb = self.chance(0.3), self.chance(0.3)
        *batch, r0, r1 = x.shape
        i, k = (r1, r0) if ta else (r0, r1)
        j = self.pick([1, 2, 3, 4, 8])
        yb = list(batch)
        # no broadcast over two or more batch dims: TF's oneDNN kernel, the reference,
        # corrupts memory on some ((3, 1, 6, 3) @ (3, 1), seed 21 #7078); gspmd-tf emits
        # them without an in-kernel broadcast (tests/test_fuzz_regressions_3.py)
        if len(batch) == 1 and self.chance(0.3):
            yb = [1 if self.chance(0.5) else n for n in batch[int(self.rng.integers(
                0, len(batch) + 1)):]]
        y = self.new_input(yb + ([j, k] if tb else [k, j]), x.dtype)
        out_batch = batch if len(batch) >= len(yb) else yb
        self.emit(f"tf.linalg.matmul({{0}}, {{1}}, transpose_a={ta}, transpose_b={tb})",
                  [x, y], list(out_batch) + [i, j], x.dtype, rounded=True, family="matmul")

    def op_bias_add(self):
        x = self.operand(lambda t: t.rank >= 2 and t.dtype in ("float32", "float64", "int32"))
        if x is None:
            x = self.new_input(self.shape(int(self.rng.integers(2, 4))), "float32")
        nchw = x.rank >= 3 and self.chance(0.3)
        c = x.shape[1] if nchw else x.shape[-1]
        b = self.new_input([c], x.dtype)
        fmt = ", data_format='NCHW'" if nchw else ""
        self.emit(f"tf.nn.bias_add({{0}}, {{1}}{fmt})", [x, b], x.shape, x.dtype,
                  family="bias_add")

    def image(self):
        def make():
            shape = [0 if self.chance(self.zero_prob) else self.pick([1, 2, 3]),
                     self.pick([1, 3, 4, 5, 6, 8]), self.pick([1, 3, 4, 5, 7]),
                     self.pick([1, 2, 3])]
            return self.new_input(shape, self.pick(["float32"] * 6 + ["float64", "float16"]))
        return self.operand(lambda t: t.rank == 4 and t.dtype in ("float32", "float64",
                                                                  "float16")
                            and np.prod(t.shape[1:3]) <= 64 and t.shape[3] > 0, make)

    def window(self, n, stride_ok=True, dilation_ok=True):
        k = self.pick([1, 2, 3])
        s = self.pick([1, 1, 2, 3]) if stride_ok else 1
        # TF's CPU kernels have no gradient of a dilated convolution
        d = self.pick([1, 1, 2]) if dilation_ok and s == 1 and not self.grad else 1
        return k, s, d

    @staticmethod
    def out_size(n, k, s, d, padding):
        eff = (k - 1) * d + 1
        if padding == "SAME":
            return -(-n // s)
        if padding == "VALID":
            return (n - eff) // s + 1 if n >= eff else None
        lo, hi = padding
        return (n + lo + hi - eff) // s + 1 if n + lo + hi >= eff else None

    @classmethod
    def one_window_cut(cls, n, k, s, d, padding):
        """Whether a dim is strided with one window: TF's oneDNN Conv2D gets such dims
        wrong when the window leaves part of the padded dim unread (seed 20 #3369) and
        also when it covers the dim (seed 22 #4493: [3, 5, 3, 1] * [3, 3, 1, 2], strides
        [1, 2], VALID: the stride-1 dim's rows 1-3 read row 4's -Inf; numpy and the same
        conv with stride 1 agree), so gspmd-tf emits stride 1 there (handlers/conv.py)
        and the fuzzer draws stride 1."""
        return s != 1 and cls.out_size(n, k, s, d, padding) == 1

    def op_conv(self):
        if self.volumes:
            self.op_conv3d()
            return
        x = self.image()
        nb, h, w, c = x.shape
        depthwise = self.chance(0.35)
        (kh, sh, dh), (kw, sw, dw) = self.window(h), self.window(w)
        if depthwise:
            sw, dw = sh, dh  # depthwise needs equal strides and dilations
        padding = self.pick(["SAME", "VALID", "EXPLICIT"])
        if depthwise and padding == "EXPLICIT":
            padding = "VALID"
        if padding == "EXPLICIT":
            pads = [[int(self.rng.integers(0, 3)) for _ in range(2)] for _ in range(2)]
            pad_text = [[0, 0], pads[0], pads[1], [0, 0]]
        else:
            pads = [padding, padding]
            pad_text = repr(padding)
        if not depthwise:
            # TF's oneDNN Conv2D (the reference) gets a strided dim with one window that
            # leaves part of the dim unread wrong: such a dim takes stride 1 (gspmd-tf
            # cuts the window out itself, handlers/conv.py: seed 20 #3369, #7733, #9413)
            sh = 1 if self.one_window_cut(h, kh, sh, dh, pads[0]) else sh
            sw = 1 if self.one_window_cut(w, kw, sw, dw, pads[1]) else sw
        oh = self.out_size(h, kh, sh, dh, pads[0])
        ow = self.out_size(w, kw, sw, dw, pads[1])
        if oh is None or ow is None or oh < 1 or ow < 1:
            return
        o = self.pick([1, 2, 3, 4])
        f = self.new_input([kh, kw, c, o], x.dtype, specials=False)
        if depthwise:
            expr = (f"tf.nn.depthwise_conv2d({{0}}, {{1}}, strides=[1, {sh}, {sh}, 1], "
                    f"padding={pad_text}, dilations=[{dh}, {dh}])")
            shape = [nb, oh, ow, c * o]
        else:
            expr = (f"tf.nn.conv2d({{0}}, {{1}}, strides=[{sh}, {sw}], padding={pad_text}, "
                    f"dilations=[{dh}, {dw}])")
            shape = [nb, oh, ow, o]
        self.emit(expr, [x, f], shape, x.dtype, rounded=True, family="conv")

    def op_pool(self):
        if self.volumes:
            self.op_pool3d()
            return
        x = self.image()
        nb, h, w, c = x.shape
        (kh, sh, _), (kw, sw, _) = self.window(h, dilation_ok=False), \
            self.window(w, dilation_ok=False)
        padding = self.pick(["SAME", "VALID"])
        oh, ow = self.out_size(h, kh, sh, 1, padding), self.out_size(w, kw, sw, 1, padding)
        if oh is None or ow is None or oh < 1 or ow < 1:
            return
        fn = self.pick(["tf.nn.max_pool2d", "tf.nn.avg_pool2d"])
        self.emit(f"{fn}({{0}}, ksize=[{kh}, {kw}], strides=[{sh}, {sw}], "
                  f"padding={padding!r})", [x], [nb, oh, ow, c], x.dtype,
                  rounded=fn.endswith("avg_pool2d"), family="pool")

    def volume(self):
        """An [N, D, H, W, C] float32 input of a 3-D conv or pool (float32: the type
        every 3-D CPU kernel takes)."""
        def make():
            shape = [0 if self.chance(self.zero_prob) else self.pick([1, 2]),
                     self.pick([1, 2, 3, 4, 5]), self.pick([1, 3, 4, 5]),
                     self.pick([1, 2, 3, 4]), self.pick([1, 2, 3])]
            return self.new_input(shape, "float32")
        return self.operand(lambda t: t.rank == 5 and t.dtype == "float32"
                            and np.prod(t.shape[1:4]) <= 64 and t.shape[4] > 0, make)

    def volume_windows(self, spatial, padding, dilation_ok):
        """(kernel, stride, dilation, output size) per spatial dim, or None when a window
        does not fit. Dilated only when no dim is strided (tf.nn.conv3d takes one or
        the other), and by the same rate on every dim: TF's Conv3D shape function
        applies a dim's dilation to another dim (input [1, 3, 3, 2, 2], filter
        [1, 3, 1, 2, 2], dilations [1, 1, 1, 2, 1]: "subtracting 5 from 3" in a graph,
        eager TF computes it). A strided dim with one window leaving part of it unread
        takes stride 1, as for Conv2D (TF's oneDNN reference)."""
        windows = [self.window(n, dilation_ok=dilation_ok) for n in spatial]
        rate = 1 if any(s > 1 for _, s, _ in windows) else windows[0][2]
        windows = [(k, s, rate) for k, s, _ in windows]
        out = []
        for n, (k, s, d) in zip(spatial, windows):
            s = 1 if self.one_window_cut(n, k, s, d, padding) else s
            size = self.out_size(n, k, s, d, padding)
            if size is None or size < 1:
                return None
            out.append((k, s, d, size))
        return out

    def op_conv3d(self):
        x = self.volume()
        nb, c = x.shape[0], x.shape[4]
        padding = self.pick(["SAME", "VALID"])
        windows = self.volume_windows(x.shape[1:4], padding, dilation_ok=True)
        if windows is None:
            return
        o = self.pick([1, 2, 3])
        f = self.new_input([w[0] for w in windows] + [c, o], x.dtype, specials=False)
        strides = [1] + [w[1] for w in windows] + [1]
        dilations = [1] + [w[2] for w in windows] + [1]
        self.emit(f"tf.nn.conv3d({{0}}, {{1}}, strides={strides}, padding={padding!r}, "
                  f"dilations={dilations})", [x, f], [nb] + [w[3] for w in windows] + [o],
                  x.dtype, rounded=True, family="conv")

    def op_pool3d(self):
        x = self.volume()
        padding = self.pick(["SAME", "VALID"])
        windows = self.volume_windows(x.shape[1:4], padding, dilation_ok=False)
        if windows is None:
            return
        fn = self.pick(["tf.nn.max_pool3d", "tf.nn.avg_pool3d"])
        self.emit(f"{fn}({{0}}, ksize={[w[0] for w in windows]}, "
                  f"strides={[w[1] for w in windows]}, padding={padding!r})", [x],
                  [x.shape[0]] + [w[3] for w in windows] + [x.shape[4]], x.dtype,
                  rounded=fn.endswith("avg_pool3d"), family="pool")

    def op_segment(self):
        x = self.operand(lambda t: t.rank >= 1 and t.dtype in ("float32", "float64", "int32"),
                         lambda: self.new_input(self.shape(), "float32"))
        k = int(self.rng.integers(1, x.rank + 1))
        segments = self.pick([1, 2, 3, 5])
        ids = self.index_input(x.shape[:k], segments, low=-1 if self.chance(0.2) else 0)
        fn = self.pick(["tf.math.unsorted_segment_sum"] * 3 + [
            "tf.math.unsorted_segment_max", "tf.math.unsorted_segment_min",
            "tf.math.unsorted_segment_prod"])
        shape = [segments] + x.shape[k:]
        self.emit(f"{fn}({{0}}, {{1}}, num_segments={segments})", [x, ids], shape, x.dtype,
                  rounded=x.is_float and fn.endswith(("sum", "prod")), family="segment")

    def op_select(self):
        x = self.operand(make=lambda: self.new_input(self.shape(), self.any_dtype()))
        if x.rank >= 2 and self.chance(0.25):
            cond = self.new_input([x.shape[0]], "bool")
            y = self.new_input(x.shape, x.dtype)
            self.emit("tf.raw_ops.Select(condition={2}, x={0}, y={1})", [x, y, cond],
                      x.shape, x.dtype, family="select")
            return
        cond_shape, out = self.broadcast_partner(x)
        conds = [t for t in self.tensors if t.dtype == "bool" and t.shape == cond_shape]
        cond = self.pick(conds) if conds and self.chance(0.5) else \
            self.new_input(cond_shape, "bool")
        y = self.new_input(out, x.dtype)
        self.emit("tf.where({2}, {0}, {1})", [x, y, cond], out, x.dtype, family="select")

    def op_cast(self):
        x = self.operand(make=lambda: self.new_input(self.shape(), self.any_dtype()))
        targets = list(FLOATS)
        if not x.is_float or (not x.rounded and not x.nonfinite):
            targets += ["int32", "bool"]
        dtype = self.pick([t for t in targets if t != x.dtype])
        if x.is_float and dtype == "int32":
            # keep the value in range: a float->int cast of a huge value is undefined
            expr = "tf.cast(tf.clip_by_value({0}, -1000, 1000), tf.int32)"
        else:
            expr = f"tf.cast({{0}}, tf.{dtype})"
        self.emit(expr, [x], x.shape, dtype, family="cast")

    def op_broadcast(self):
        if self.chance(0.3):
            shape = self.shape()
            dtype = self.pick(["float32", "int32"])
            value = 1.5 if dtype == "float32" else 3
            self.emit(f"tf.fill({shape}, tf.constant({value}, tf.{dtype}))", [], shape,
                      dtype, family="broadcast")
            return
        x = self.operand(lambda t: t.rank <= 3 and t.size <= 48)
        if x is None:
            return
        shape = [self.pick([2, 3, 4]) if n == 1 and self.chance(0.6) else n for n in x.shape]
        shape = [self.pick([1, 2, 3]) for _ in range(int(self.rng.integers(0, 2)))] + shape
        if np.prod(shape) > MAX_ELEMENTS:
            return
        self.emit(f"tf.broadcast_to({{0}}, {shape})", [x], shape, x.dtype, family="broadcast")

    # ------------------------------------------------------------ roll, while, cond
    def op_roll(self):
        """tf.roll with constant shifts (negative, or past the dim) on one or more axes."""
        x = self.operand(lambda t: any(t.shape),
                         lambda: self.new_input(self.shape(), self.any_dtype()))
        dims = [d for d, n in enumerate(x.shape) if n > 0]
        if not dims:
            return
        k = int(self.rng.integers(1, min(3, len(dims)) + 1))
        axes = [int(d) for d in self.rng.choice(dims, k, replace=False)]
        shifts = [int(self.rng.integers(-2 * x.shape[d] - 1, 2 * x.shape[d] + 2))
                  for d in axes]
        axes = [d - x.rank if self.chance(0.3) else d for d in axes]
        if k == 1 and self.chance(0.5):
            expr = f"tf.roll({{0}}, {shifts[0]}, axis={axes[0]})"
        else:
            expr = f"tf.roll({{0}}, shift={shifts}, axis={axes})"
        self.emit(expr, [x], x.shape, x.dtype, family="roll")

    def captured(self, shape, dtype, args):
        """A program tensor of `shape` and `dtype` (an existing one or a new input) used
        inside a body: appended to args, returned as its placeholder."""
        same = [t for t in self.tensors if t.shape == list(shape) and t.dtype == dtype]
        t = self.pick(same) if same and self.chance(0.5) else self.new_input(shape, dtype)
        args.append(t)
        return f"{{{len(args) - 1}}}"

    def body_step(self, v, shape, dtype, args, partners):
        """One shape-preserving step of a while body or cond branch applied to the text
        `v` (a value of `shape` and `dtype`): (text, whether it sums). partners: other
        texts of that shape and dtype in scope; captured tensors are appended to args."""
        kinds = ["unary", "binary", "reduce", "roll"] + (["matmul"] if len(shape) >= 2 else [])
        kind = self.pick(kinds)
        if kind == "unary":
            return self.pick(BODY_UNARY).format(v=v), False
        if kind == "binary":
            other = self.pick(partners) if partners and self.chance(0.6) else \
                self.captured(shape, dtype, args)
            return f"{self.pick(BODY_BINARY)}({v}, {other})", False
        if kind == "matmul":  # scaled by 1/4 (exactly) so a few iterations stay bounded
            # a square matrix, or for two or more batch dims one per batch: as in
            # op_matmul, no broadcast over two or more batch dims, on which TF's oneDNN
            # kernel (the reference) corrupts the heap: (5, 1, 8, 2) @ (2, 2), seed 24 #3785
            batch = list(shape[:-2]) if len(shape) > 3 else []
            w = self.captured(batch + [shape[-1], shape[-1]], dtype, args)
            return f"tf.matmul({v}, {w}) * 0.25", True
        axis = int(self.rng.integers(len(shape)))
        if kind == "roll":
            n = shape[axis]
            return f"tf.roll({v}, {int(self.rng.integers(-2 * n - 1, 2 * n + 2))}, " \
                f"axis={axis})", False
        fn = self.pick(["reduce_mean", "reduce_max", "reduce_sum"])
        return (f"{v} * 0.5 - tf.{fn}({v}, axis={axis}, keepdims=True) * 0.25",
                fn != "reduce_max")

    def op_while(self):
        """tf.while_loop with a fixed trip count over 1-2 carried tensors of fixed shape,
        1-3 body steps, optionally a TensorArray of a per-iteration value, stacked."""
        x = self.operand(lambda t: t.is_float and 1 <= t.rank <= 3 and t.size <= 96,
                         lambda: self.new_input(self.shape(int(self.rng.integers(1, 4))),
                                                self.float_dtype()))
        if not (x.is_float and 1 <= x.rank <= 3 and x.size <= 96):
            return
        args = [x]
        if self.chance(0.4):
            self.captured(x.shape, x.dtype, args)
        names = [f"c{k}_" for k in range(len(args))]
        counter = f"tf.cast(i_, tf.{x.dtype})"
        chains = [[name] for name in names]  # each carried value after each body step
        rounded = False
        for _ in range(int(self.rng.integers(1, 4))):
            j = int(self.rng.integers(len(names)))
            partners = [n for n in names if n != names[j]] + [counter]
            text, sums = self.body_step(chains[j][-1], x.shape, x.dtype, args, partners)
            chains[j].append(text)
            rounded = rounded or sums
        array = None
        if self.chance(0.35):
            array = self.pick(["{}", "tf.reduce_sum({}, axis=0)", "{} * " + counter])
        result = len(names) if array else int(self.rng.integers(len(names)))
        trips = int(self.rng.integers(1, 5))

        def render(trips, news):
            params = ", ".join(["i_"] + names + (["ta_"] if array else []))
            new = ["i_ + 1"] + news + ([f"ta_.write(i_, {array.format(news[0])})"]
                                       if array else [])
            init = ["tf.constant(0)"] + [f"{{{k}}}" for k in range(len(names))] + (
                [f"tf.TensorArray(tf.{x.dtype}, size={trips})"] if array else [])
            loop = (f"tf.while_loop(lambda {params}: i_ < {trips}, lambda {params}: "
                    f"({', '.join(new)}), ({', '.join(init)}))[{result + 1}]")
            return loop + ".stack()" if array else loop

        def shape(trips):
            if not array:
                return list(x.shape)
            element = x.shape[1:] if "reduce_sum" in array else x.shape
            return [trips] + list(element)

        news = [chain[-1] for chain in chains]
        simpler = [(1, news)] + [(trips, news[:j] + [chain[-2]] + news[j + 1:])
                                 for j, chain in enumerate(chains) if len(chain) > 1]
        variants = [{"expr": render(t, n), "args": [a.name for a in args], "shape": shape(t)}
                    for t, n in simpler if (t, n) != (trips, news)]
        self.emit(render(trips, news), args, shape(trips), x.dtype, rounded=rounded,
                  family="while", variants=variants)

    def op_cond(self):
        """tf.cond on a data-dependent scalar predicate with two drawn branches of x's
        shape and dtype."""
        x = self.operand(lambda t: t.is_float and t.rank >= 1,
                         lambda: self.new_input(self.shape(), self.float_dtype()))
        args = [x]
        p = x if self.chance(0.5) else self.operand()
        if p is not x:
            args.append(p)
        # a max is exact in any order; a sum of a tensor that already went through sums
        # could round to the other side of 0 when partitioned
        fn = "reduce_max" if p.rounded or self.chance(0.3) else "reduce_sum"
        pred = f"tf.{fn}(tf.cast({{{len(args) - 1}}}, tf.float32)) > 0"
        branches, rounded = [], False
        for _ in range(2):
            text = "{0}"
            for _ in range(int(self.rng.integers(1, 3))):
                text, sums = self.body_step(text, x.shape, x.dtype, args, [])
                rounded = rounded or sums
            branches.append(text)
        names = [a.name for a in args]
        variants = [{"expr": b, "args": names, "shape": x.shape} for b in branches]
        self.emit(f"tf.cond({pred}, lambda: {branches[0]}, lambda: {branches[1]})", args,
                  x.shape, x.dtype, rounded=rounded, family="cond", variants=variants)

    def op_no_rule(self):
        x = self.operand(lambda t: t.rank >= 1 and t.dtype in ("float32", "int32"))
        if x is None:
            return
        axis = int(self.rng.integers(0, x.rank))
        fn = self.pick([f"tf.reverse({{0}}, [{axis}])", f"tf.math.cumsum({{0}}, axis={axis})",
                        f"tf.roll({{0}}, 1, axis={axis})"])
        self.emit(fn, [x], x.shape, x.dtype, rounded=fn.startswith("tf.math.cumsum"),
                  family="no_rule")


def _is_index(item):
    return item.lstrip("-").isdigit()


def generate(seed, index, ops=(2, 12), families=None, grad_prob=0.15, meshes=None,
             zero_prob=0.04, variable_prob=0.1, volume_prob=0.25, control_flow_prob=0.2):
    """Program number `index` of the run with `seed` (independent of every other).

    ops: (min, max) number of ops; families: op families to draw from (None: all);
    meshes: mesh shapes to draw from (None: MESHES); zero_prob: chance of a 0 in each
    drawn dim (slices may still empty a dim); variable_prob: chance that the program
    reads and updates variables (drawn apart, so the other programs stay the same);
    volume_prob: chance that its conv and pool ops are 3-D (drawn apart too);
    control_flow_prob: chance that it may also draw the roll, while and cond families
    (drawn apart too; always when `families` names one of them)."""
    rng = np.random.default_rng([seed, index])
    variables = np.random.default_rng([seed, index, 1]).random() < variable_prob
    volumes = np.random.default_rng([seed, index, 2]).random() < volume_prob
    control_flow = (np.random.default_rng([seed, index, 3]).random() < control_flow_prob
                    or bool(families and set(families) & set(CONTROL_FLOW_FAMILIES)))
    # short programs are cheaper and shrink faster; long ones still come up often
    num_ops = min(ops[1], ops[0] + int(rng.geometric(1 / (1 + (ops[1] - ops[0]) / 3))) - 1)
    return Generator(rng, num_ops, families, grad_prob, meshes, zero_prob,
                     variables, volumes, control_flow).program()


# ---------------------------------------------------------------------- rendering

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


__all__ = ["generate", "source", "snippet", "describe", "all_families", "spec_source",
           "watched", "output_precisions", "loosest"]
