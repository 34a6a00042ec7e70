"""The generator's control-flow op families: tf.roll, tf.while_loop and tf.cond (a mixin
of gspmd_tf.testing.generator.Generator; drawn only by control-flow programs)."""

from __future__ import annotations

from gspmd_tf.testing.program_space import BODY_BINARY, BODY_UNARY


class ControlFlowOps:
    """op_roll, op_while, op_cond: each appends one op of its family to the program (self is
    a Generator)."""

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
