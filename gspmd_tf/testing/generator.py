"""The random program generator of the differential fuzzer (benchmarks/fuzz.py).

A program is plain data (JSON-able): a mesh, inputs (shape, dtype, value recipe, spec), a
list of ops (each a Python expression over earlier tensors, its result shape and dtype,
an optional gt.mesh_split hint), the outputs, optional out_shardings and an optional
gradient. gspmd_tf.testing.program_text renders it as Python; the fuzzer's worker
executes exactly that text, so a reported program is the program that ran.

Generator's core (mesh, inputs, specs, variables, the program) is here; the op families
are its mixins: ArrayOps (elementwise, layout and indexing ops), ComputeOps (reductions,
contractions, windows) and ControlFlowOps (roll, while, cond). Everything is
deterministic per (seed, index).
"""

from __future__ import annotations

import numpy as np

from gspmd_tf.testing.array_ops import ArrayOps
from gspmd_tf.testing.compute_ops import ComputeOps
from gspmd_tf.testing.control_flow_ops import ControlFlowOps
from gspmd_tf.testing.program_space import (AXIS_NAMES, CONTROL_FLOW_FAMILIES, DIMS, FAMILIES,
                                            FLOATS, MAX_ELEMENTS, MESHES, Tensor, loosest)


class Generator(ArrayOps, ComputeOps, ControlFlowOps):
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
        """True with probability p."""
        return self.rng.random() < p

    def pick(self, seq):
        """A random element of seq."""
        return seq[self.rng.integers(len(seq))]

    def dim(self):
        """A random dim size (0 with probability zero_prob)."""
        if self.chance(self.zero_prob):
            return 0
        return int(self.pick(DIMS))

    def shape(self, rank=None):
        """A random shape of `rank` dims (1-3 if None) of at most MAX_ELEMENTS elements."""
        rank = int(self.rng.integers(1, 4)) if rank is None else rank
        for _ in range(20):
            shape = [self.dim() for _ in range(rank)]
            if np.prod(shape) <= MAX_ELEMENTS:
                return shape
        return [1] * rank

    def float_dtype(self):
        """A random float dtype, float32 most often."""
        r = self.rng.random()
        return "float32" if r < 0.8 else "float64" if r < 0.88 else "float16" if r < 0.94 \
            else "bfloat16"

    def any_dtype(self):
        """A random dtype: mostly floats, some int32 and bool."""
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
        """A float tensor of `rank` (or at least `min_rank`) dims, existing or fresh."""
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
        """The finished program (plain data): mesh, inputs, ops, outputs, shardings."""
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
