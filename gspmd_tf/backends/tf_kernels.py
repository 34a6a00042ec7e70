"""How TF ops are called on TF's own kernels: the legalizations a backend that runs ops
on TF's kernels applies (the local backend; the XLA backend's op-by-op nodes and the
ops inside its segments, which TF's bridge lowers from the same TF ops), and the
grappler settings of the programs it builds.

The tables say, per op type, what TF's kernel of it needs: CPU_KERNELS on CPU devices
(inputs in channels-last layout, KernelNeeds.channels_last; an input sliced to end at
its last window, KernelNeeds.input_ending_at_last_window), ANY_DEVICE_KERNELS on every
device (explicit padding as a pad of the input, KernelNeeds.explicit_padding_as_pad).
Each entry says why. Ops the tables do not name are created as they are. The op's own
knowledge (its rule, emitter, costs, numerics) is its registry entry; these tables hold
only what one runtime's kernels need, as XLA keeps per-backend rewrites beside its
backends.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Optional

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.framework import ops

from gspmd_tf.backends import graph_ops
from gspmd_tf.errors import ShardingError


@dataclass(frozen=True)
class KernelNeeds:
    """What TF's CPU kernel of an op type needs.

    channels_last: the kernel takes only NHWC (NDHWC): (positions of the inputs in
        NCHW, positions of inputs that are NCHW shape vectors, whether the output is
        NCHW); the op then runs between transposes.
    input_ending_at_last_window: the kernel is given its input sliced where it extends
        past the last window (input_ending_at_last_window).
    explicit_padding_as_pad: an op with EXPLICIT padding runs VALID on its input (input
        0) padded with zeros by those amounts."""

    channels_last: Optional[tuple] = None
    input_ending_at_last_window: bool = False
    explicit_padding_as_pad: bool = False


# Windowed ops whose CPU kernels take only NHWC: a single-device tf.function relies on
# grappler's layout optimizer for these, which is not guaranteed to run on the SPMD
# program, so the backend transposes itself.
# Conv2DBackpropFilter's CPU kernel is given an input ending at the last window: TF
# 2.21's oneDNN Conv2DBackpropFilter corrupts the heap (SIGABRT "free(): invalid size",
# SIGSEGV within a few hundred calls; Eigen's kernels, TF_ENABLE_ONEDNN_OPTS=0, never
# do) for some strided windows that leave input rows past the last window, e.g. input
# (3, 8, 5, 2), 1x1 filter, stride (2, 1), VALID (fuzzer seed 31 #814; the grid of
# benchmarks/conv_filter_crash_grid.py in benchmarks/RESULTS.md §6: no input ending at
# its last window crashed, nor did the depthwise and 3-D filter gradients on the same
# shapes). Those rows contribute nothing to the filter gradient, so slicing them off is
# exact.
CPU_KERNELS = {
    "Conv2D": KernelNeeds(channels_last=((0,), (), True)),
    "Conv2DBackpropInput": KernelNeeds(channels_last=((2,), (0,), True)),
    "Conv2DBackpropFilter": KernelNeeds(channels_last=((0, 2), (), False),
                                        input_ending_at_last_window=True),
    "DepthwiseConv2dNative": KernelNeeds(channels_last=((0,), (), True)),
    "DepthwiseConv2dNativeBackpropInput": KernelNeeds(channels_last=((2,), (0,), True)),
    "DepthwiseConv2dNativeBackpropFilter": KernelNeeds(channels_last=((0, 2), (), False)),
    "MaxPool": KernelNeeds(channels_last=((0,), (), True)),
    "AvgPool": KernelNeeds(channels_last=((0,), (), True)),
    "MaxPoolGrad": KernelNeeds(channels_last=((0, 1, 2), (), True)),
    "AvgPoolGrad": KernelNeeds(channels_last=((1,), (0,), True)),
    # the other 3-D CPU kernels take NCDHW
    "MaxPool3DGrad": KernelNeeds(channels_last=((0, 1, 2), (), True)),
}
# TF's graph optimizer aborts the process on a DepthwiseConv2dNative with EXPLICIT
# padding that feeds a BiasAdd, single-device tf.function too (fuzzer seed 22 #2960,
# #9704: input (2, 1, 4, 3), filter (1, 2, 3, 2), strides [1, 3, 3, 1], paddings
# [[0, 0], [0, 0], [0, 1], [0, 0]]: "Check failed: index >= 0 && index <
# num_total_dims"); the partitioner makes such paddings when it cuts a window.
ANY_DEVICE_KERNELS = {
    "DepthwiseConv2dNative": KernelNeeds(explicit_padding_as_pad=True),
}
_CHANNELS_LAST = {b"NCHW": b"NHWC", b"NCDHW": b"NDHWC"}
_NO_NEEDS = KernelNeeds()


def tf_op_emitter(node, devices):
    """Emitter emit(d, inputs) re-creating the TF op of `node` (an SPMD program node) on
    device d of `devices` (device names; None for no device), legalized for its
    kernel there (CPU_KERNELS); inputs[k][d] is input k on device d."""
    # Underscore attrs (_class, _XlaSharding, ...) describe the traced graph, not the op;
    # colocation constraints in particular would fight the per-device placement.
    attrs = {k: v for k, v in node.attrs.items() if not k.startswith("_")}
    name = safe_name(node.name)
    anywhere = ANY_DEVICE_KERNELS.get(node.op, _NO_NEEDS)
    on_cpus = CPU_KERNELS.get(node.op, _NO_NEEDS)
    pads = None
    if anywhere.explicit_padding_as_pad and attrs.get("padding") is not None and \
            attrs["padding"].s == b"EXPLICIT":
        pairs = list(attrs["explicit_paddings"].list.i)
        pads = [pairs[k:k + 2] for k in range(0, len(pairs), 2)]
        attrs = dict(attrs, padding=attr_value_pb2.AttrValue(s=b"VALID"),
                     explicit_paddings=attr_value_pb2.AttrValue(
                         list=attr_value_pb2.AttrValue.ListValue(i=[])))
    channels_last = on_cpus.channels_last is not None and attrs.get("data_format") is \
        not None and attrs["data_format"].s in _CHANNELS_LAST
    transposed = _channels_last_attrs(attrs) if channels_last else None

    # graph_ops.OpTemplate of the node's attrs ("plain") and of its channels-last attrs,
    # made on first use and shared by every device's copy; other attrs get their own
    templates = {}

    def create(args, op_attrs, d):
        graph = ops.get_default_graph()
        kind = "plain" if op_attrs is attrs else "channels_last" if \
            transposed is not None and op_attrs is transposed[0] else None
        template = templates.get(kind)
        if template is None:
            template = graph_ops.OpTemplate(graph.op_def_for_type(node.op), op_attrs)
            if kind is not None:
                templates[kind] = template
        return graph_ops.create_op(template, args, node.out_dtypes, f"{name}_d{d}",
                                   devices[d])

    def emit(d, ins):
        args = [x[d] for x in ins]
        if pads is not None:
            args[0] = tf.pad(args[0], pads)
        needs = on_cpus if devices[d] is not None and on_cpu(devices[d]) else _NO_NEEDS
        if needs is _NO_NEEDS:
            return create(args, attrs, d)
        op_attrs, to_first = attrs, None
        if channels_last:
            args, op_attrs, to_first = _to_channels_last(needs.channels_last, args,
                                                         transposed)
        if needs.input_ending_at_last_window:
            args, op_attrs = input_ending_at_last_window(node, args, op_attrs)
        op = create(args, op_attrs, d)
        if to_first is None:
            return op
        return tf.transpose(op.outputs[0], to_first) if needs.channels_last[2] \
            else op.outputs[0]
    return emit


def _channels_last_attrs(attrs):
    """(attrs of the channels-last op, permutation to channels last, permutation back)
    of an op with NCHW (NCDHW) `attrs`: data_format and per-dim attrs permuted."""
    channels_first = attrs["data_format"].s
    rank = len(channels_first)
    to_last = [0] + list(range(2, rank)) + [1]  # NCHW -> NHWC, NCDHW -> NDHWC
    to_first = [0, rank - 1] + list(range(1, rank - 1))
    nhwc = dict(attrs, data_format=attr_value_pb2.AttrValue(s=_CHANNELS_LAST[channels_first]))
    for key in ("strides", "dilations", "ksize"):
        if key in attrs and len(attrs[key].list.i) == rank:
            values = list(attrs[key].list.i)
            nhwc[key] = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                i=[values[k] for k in to_last]))
    if "explicit_paddings" in attrs and len(attrs["explicit_paddings"].list.i) == 2 * rank:
        pairs = list(attrs["explicit_paddings"].list.i)
        nhwc["explicit_paddings"] = attr_value_pb2.AttrValue(
            list=attr_value_pb2.AttrValue.ListValue(
                i=[v for k in to_last for v in pairs[2 * k:2 * k + 2]]))
    return nhwc, to_last, to_first


def _to_channels_last(channels_last, args, transposed):
    """(args, attrs, permutation of the output back) of the channels-last op: the data
    inputs transposed, the shape-vector inputs permuted."""
    data, vectors, _ = channels_last
    nhwc, to_last, to_first = transposed
    moved = []
    for k, x in enumerate(args):
        if k in data:
            moved.append(tf.transpose(x, to_last))
        elif k in vectors:
            moved.append(tf.gather(x, to_last))
        else:
            moved.append(x)
    return moved, nhwc, to_first


def input_ending_at_last_window(node, args, attrs):
    """(args, attrs) of filter-gradient `node` (inputs: input, filter_sizes,
    out_backprop; NHWC: NCHW ones come through _to_channels_last's transposes) with the
    input sliced, on every spatial dim where it extends past the last window (static
    shapes), to end there, and the padding made to agree: the high pad of a sliced dim
    is 0, so SAME (whose pads are 0 on such a dim, or it would reach the end) becomes
    VALID if no dim is padded, else EXPLICIT. Unchanged if no dim extends past its last
    window or a shape is not static."""
    x, dy = args[0], args[2]
    rank = len(node.out_shapes[0])
    if not (x.shape.is_fully_defined() and dy.shape.is_fully_defined()) or \
            x.shape.num_elements() == 0 or dy.shape.num_elements() == 0:
        return args, attrs
    padding = attrs["padding"].s
    pairs = (list(attrs["explicit_paddings"].list.i) if padding == b"EXPLICIT"
             else [0] * 2 * rank)
    dilations = list(attrs["dilations"].list.i) if "dilations" in attrs else [1] * rank
    sizes = x.shape.as_list()
    for window, dim in zip(node.out_shapes[0], range(1, rank - 1)):
        stride, extent, out = attrs["strides"].list.i[dim], sizes[dim], dy.shape[dim]
        span = (window - 1) * dilations[dim] + 1
        if padding == b"SAME":
            total = max((out - 1) * stride + span - extent, 0)
            pairs[2 * dim:2 * dim + 2] = [total // 2, total - total // 2]
        end = (out - 1) * stride + span - pairs[2 * dim]  # one past the last window's row
        if end < extent:
            sizes[dim], pairs[2 * dim + 1] = end, 0
    if sizes == x.shape.as_list():
        return args, attrs
    trimmed = dict(attrs, padding=attr_value_pb2.AttrValue(
        s=b"EXPLICIT" if any(pairs) else b"VALID"))
    trimmed.pop("explicit_paddings", None)
    if any(pairs):
        trimmed["explicit_paddings"] = attr_value_pb2.AttrValue(
            list=attr_value_pb2.AttrValue.ListValue(i=pairs))
    return [tf.slice(x, [0] * rank, sizes)] + list(args[1:]), trimmed


@functools.lru_cache(maxsize=None)
def on_cpu(device):
    """Whether `device` (a device string) is a CPU."""
    return "CPU" in tf.DeviceSpec.from_string(device).device_type.upper()


def safe_name(name):
    """`name` made into a valid TF op name."""
    name = re.sub(r"[^A-Za-z0-9_.\-/]", "_", name).strip("/")
    return name if re.match(r"[A-Za-z0-9.]", name) else "n" + name


def call_attrs(options, cpu_only):
    """The function call attrs of `options` (the context's) with two grappler passes
    off, which rewrite the SPMD program wrongly:
    - the arithmetic optimizer: where annotations no longer separate the ops, it
      rewrites tf.maximum(x, tf.add_n([x, x])) into a wrong value (x where x > 0; fuzzer
      seed 24 #2965, seed 47 #129; a single-device tf.function of the same ops is wrong
      too) and ArgMax(Sign(x)) into ArgMax(x), another index where Sign ties (seed 21
      #165);
    - the remapper: it fuses add(c, matmul(a, b)) into one MatMul with c as its "bias"
      when c has the shape (1, ..., 1, N) and the product more than one element, and the
      fused kernel then refuses a c of rank 2 or more. Local shapes make that pattern
      where the global ones do not: a (1, 3) product plus a (1, 1, 1) runs on one
      device, its (1, 1) shards fail (seed 36 #2904; seed 31 #9463 fails on one device
      too). Off, the FFN train step and ResNet50's data-parallel step measured the same
      (benchmarks/RESULTS.md §6, "The eleventh run").
    With `cpu_only` (every device of the mesh a CPU) the grappler passes in
    _SLOW_ON_CPU are off too, where the context leaves them at TF's default."""
    key = (options.config_proto_serialized, options.executor_type or "", cpu_only)
    if key not in _CALL_ATTRS:
        config = config_pb2.ConfigProto.FromString(key[0])
        rewrites = config.graph_options.rewrite_options
        rewrites.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
        rewrites.remapping = rewriter_config_pb2.RewriterConfig.OFF
        for field, value in (_SLOW_ON_CPU if cpu_only else ()):
            if not getattr(rewrites, field):  # 0: TF's default, not the user's choice
                setattr(rewrites, field, value)
        _CALL_ATTRS[key] = ("executor_type", key[1],
                            "config_proto", config.SerializeToString())
    return _CALL_ATTRS[key]


# Grappler settings of the SPMD program on CPU meshes: each pass here cost seconds on the
# first call of the 64-layer FFN train step (a program of 8x the single-device ops) and
# measured no gain on its steady step (benchmarks/RESULTS.md §14, "Time to first step").
# Not applied on other devices, where the layout and memory optimizers do work (NCHW
# convolutions, swapping) that was not measured here.
_SLOW_ON_CPU = (
    ("disable_tfg_optimizer", True),   # MLIR passes: attribute and control-flow clean-ups
    ("experimental_conditional_code_motion", rewriter_config_pb2.RewriterConfig.OFF),
    ("memory_optimization", rewriter_config_pb2.RewriterConfig.NO_MEM_OPT),
    ("layout_optimizer", rewriter_config_pb2.RewriterConfig.OFF),  # no CPU conversion
    ("constant_folding", rewriter_config_pb2.RewriterConfig.OFF),  # the importer folds
    ("meta_optimizer_iterations", rewriter_config_pb2.RewriterConfig.ONE),
)


# (the context's serialized ConfigProto, executor type, cpu_only) -> call attrs
_CALL_ATTRS = {}


def identity(x):
    """tf.identity(x) of a graph tensor, without tf.identity's dispatch and op-def
    layers (they doubled the cost of the lowering's most frequent op: one per program
    input and device). Like tf.identity, the result keeps a resource handle's data."""
    result = graph_ops.create_op(graph_ops.simple_template("Identity", x.dtype), [x],
                                 [x.dtype], "Identity").outputs[0]
    if hasattr(x, "_handle_data"):
        result._handle_data = x._handle_data
    return result


def add_n(tensors):
    """tf.add_n of graph tensors of one dtype, created directly: tf.add_n's dispatch and
    op-def layers cost ~0.35 ms per op against ~0.07 ms, and without the all-reduce
    combiner the copy all-reduces are one AddN per gradient and group (1,282 for the
    64-layer FFN step)."""
    dtype = tensors[0].dtype
    return graph_ops.create_op(graph_ops.simple_template("AddN", dtype, len(tensors)),
                               tensors, [dtype], "AddN").outputs[0]


def set_shapes(node, tensors):
    """Gives `tensors` the program's static local shapes, which TF's shape inference
    cannot always derive (collectives' outputs, reads of variable handles fed without
    handle data). A resource or TensorList tensor is a scalar handle: its program shape
    is its value's (a TensorList's: its element's)."""
    for tensor, shape in zip(tensors, node.out_shapes):
        if tensor.dtype in (tf.resource, tf.variant):  # scalar handles to TF
            continue
        known = tensor.shape
        if known.rank == len(shape) and known.as_list() == list(shape):
            continue  # TF inferred it (most ops): set_shape would cost ~4x this check
        try:
            tensor.set_shape(shape)
        except ValueError:
            raise ShardingError(
                f"node {node.name} ({node.op}): the program says its local shape is "
                f"{shape}, TF computes {tensor.shape}") from None
