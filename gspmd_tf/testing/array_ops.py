"""The generator's elementwise, layout and indexing op families (a mixin of
gspmd_tf.testing.generator.Generator)."""

from __future__ import annotations

import numpy as np

from gspmd_tf.testing.program_space import (BINARY_BOOL, BINARY_FLOAT, BINARY_FLOAT_ILL,
                                            BINARY_INT, BOOL_RESULT, FLOATS, MAX_ELEMENTS,
                                            NONFINITE_MAKERS, UNARY_BOOL, UNARY_FLOAT,
                                            UNARY_FLOAT_ILL, UNARY_INT)


def _is_index(item):
    return item.lstrip("-").isdigit()


class ArrayOps:
    """op_unary ... op_one_hot, op_segment ... op_broadcast, op_no_rule: each appends one op
    of its family to the program (self is a Generator)."""

    def op_unary(self):
        """An elementwise unary op fitting the operand's dtype (ill-conditioned ones, which may
        make NaN/Inf, only of values that do not depend on summation order)."""
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
        """An elementwise binary op with a tensor of the same shape or a fresh broadcasting
        input, in either order."""
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
        """tf.add_n of two or three tensors of one shape and dtype."""
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
        """A reshape to a random factorization of the operand's size."""
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
        """tf.squeeze of one or every size-1 dim, or tf.expand_dims at a random axis."""
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
        """A transpose by a random permutation."""
        x = self.operand(lambda t: t.rank >= 2,
                         lambda: self.new_input(self.shape(int(self.rng.integers(2, 4))),
                                                self.any_dtype()))
        perm = [int(p) for p in self.rng.permutation(x.rank)]
        self.emit(f"tf.transpose({{0}}, {perm})", [x], [x.shape[p] for p in perm], x.dtype,
                  family="transpose")

    def op_slice(self):
        """tf.slice with random in-range begin and size."""
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
        """A Python getitem: strides, negative indices, ellipsis, new axes, shrinks."""
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
        """tf.pad with random paddings: constant (value 0, 1 or -2), reflect or symmetric."""
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
        """tf.concat of the operand with itself or fresh inputs along a random axis."""
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
        """tf.tile by random multiples."""
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
        """tf.gather along a random axis with in-range indices of rank 0 to 2."""
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
        """tf.one_hot of fresh indices, -1 and depth included (all-off rows)."""
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

    def op_segment(self):
        """An unsorted segment reduction with random segment ids."""
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
        """tf.where with a broadcasting condition, or tf.raw_ops.Select with a condition on
        the first dim."""
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
        """tf.cast to another float type, or to int32 or bool where the value allows
        (floats clipped before an int32 cast)."""
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
        """tf.fill of a constant, or tf.broadcast_to of a small tensor over larger or more dims."""
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

    def op_no_rule(self):
        """An op that ran without a partitioning rule when the family was made (cumsum,
        reverse, roll)."""
        x = self.operand(lambda t: t.rank >= 1 and t.dtype in ("float32", "int32"))
        if x is None:
            return
        axis = int(self.rng.integers(0, x.rank))
        fn = self.pick([f"tf.reverse({{0}}, [{axis}])", f"tf.math.cumsum({{0}}, axis={axis})",
                        f"tf.roll({{0}}, 1, axis={axis})"])
        self.emit(fn, [x], x.shape, x.dtype, rounded=fn.startswith("tf.math.cumsum"),
                  family="no_rule")
