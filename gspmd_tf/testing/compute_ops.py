"""The generator's reduction, contraction and window op families (a mixin of
gspmd_tf.testing.generator.Generator)."""

from __future__ import annotations

import math

import numpy as np

from gspmd_tf.testing.program_space import DIMS, HALF, MAX_ELEMENTS


class ComputeOps:
    """op_reduce ... op_pool3d: each appends one op of its family to the program (self is a
    Generator)."""

    def op_reduce(self):
        """A reduction (sum, mean, max, min, prod, all, any) over random axes."""
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
        """tf.argmax or tf.argmin along a random axis."""
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
        """softmax or log_softmax along a random axis."""
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
        """A softmax cross-entropy, dense (soft labels) or sparse."""
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
        """tf.einsum of one or two operands with random letters (shared, contracted, summed
        out, repeated)."""
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
        """tf.linalg.matmul with random transposes and batch dims (broadcasting over at most
        one batch dim)."""
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
        # them without an in-kernel broadcast (tests/test_reduction_numerics.py)
        if len(batch) == 1 and self.chance(0.3):
            yb = [1 if self.chance(0.5) else n for n in batch[int(self.rng.integers(
                0, len(batch) + 1)):]]
        y = self.new_input(yb + ([j, k] if tb else [k, j]), x.dtype)
        out_batch = batch if len(batch) >= len(yb) else yb
        self.emit(f"tf.linalg.matmul({{0}}, {{1}}, transpose_a={ta}, transpose_b={tb})",
                  [x, y], list(out_batch) + [i, j], x.dtype, rounded=True, family="matmul")

    def op_bias_add(self):
        """tf.nn.bias_add of a fresh bias vector, NHWC or NCHW."""
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
        """A small rank-4 float NHWC operand: an existing one or a fresh input."""
        def make():
            shape = [0 if self.chance(self.zero_prob) else self.pick([1, 2, 3]),
                     self.pick([1, 3, 4, 5, 6, 8]), self.pick([1, 3, 4, 5, 7]),
                     self.pick([1, 2, 3])]
            return self.new_input(shape, self.pick(["float32"] * 6 + ["float64", "float16"]))
        return self.operand(lambda t: t.rank == 4 and t.dtype in ("float32", "float64",
                                                                  "float16")
                            and np.prod(t.shape[1:3]) <= 64 and t.shape[3] > 0, make)

    def window(self, n, stride_ok=True, dilation_ok=True):
        """A random (kernel, stride, dilation) for one spatial dim (no dilation with a stride
        or a gradient)."""
        k = self.pick([1, 2, 3])
        s = self.pick([1, 1, 2, 3]) if stride_ok else 1
        # TF's CPU kernels have no gradient of a dilated convolution
        d = self.pick([1, 1, 2]) if dilation_ok and s == 1 and not self.grad else 1
        return k, s, d

    @staticmethod
    def out_size(n, k, s, d, padding):
        """The output size of a window of kernel k, stride s, dilation d over n."""
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
        """tf.nn.conv2d or tf.nn.depthwise_conv2d with random windows and padding (3-D in
        volume programs)."""
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
        """A 2-D max or average pool (3-D in volume programs)."""
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
        """A 3-D convolution over a volume."""
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
        """A 3-D max or average pool over a volume."""
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
