"""Inputs for the op sweep (op_sweep.py) where an op's OpDef alone gives none that TF
accepts: ranks the op needs (a rank-1 bias, NHWC images, 5-D volumes), shape and index
tensors of valid values, attrs without defaults, complex inputs, sorted segment ids,
sparse tensors. RECIPES maps an op type to its Recipe.

Split inputs (Arg kinds "random" and "given") get the sweep's random layouts; constants
(kind "constant": shapes, axes, windows, sparse indices) are fixed at trace time, as a
model's are. Shapes are small and uneven over the 2x4 mesh (6 and 5 over 4 devices).
An input TF cannot take as an argument of numbers (a TensorList, a CSR sparse matrix,
strings) is `made` inside the program from a numeric one (Made: tf.strings.as_string of
split floats, TensorListFromTensor of a split tensor), and an op whose result is such
a value is `finish`ed into numbers (TensorListStack, CSRSparseMatrixToDense), as the
models holding these ops read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.saved_model import nested_structure_coder


@dataclass(frozen=True)
class Arg:
    """One input: `kind` "random" (normal floats, or integers in [0, high) when `high`
    is given; complex dtypes get a normal imaginary part), "given" (`value`, split like a
    random one), "constant" (`value`, a constant of the program) or "variable" (a
    variable holding a random value, split like a random input: the op gets its handle,
    and the sweep compares its value after the call too); `make`, when set, builds the
    op's input from this one inside the program (see Made)."""

    kind: str
    dtype: str
    shape: tuple = ()
    value: Optional[object] = None
    high: Optional[int] = None
    make: Optional[Callable] = None

    def array(self, rng: np.random.Generator) -> np.ndarray:
        """The input's value, drawn from `rng` for a random Arg."""
        if self.kind in ("given", "constant") or self.value is not None:
            return np.asarray(self.value, dtype=self.dtype)
        if self.high is not None:
            return rng.integers(0, self.high, self.shape).astype(self.dtype)
        value = rng.standard_normal(self.shape)
        if np.dtype(self.dtype).kind == "c":
            value = value + 1j * rng.standard_normal(self.shape)
        return value.astype(self.dtype)


@dataclass(frozen=True)
class Recipe:
    """An op's inputs in OpDef order (an Arg, or a list of Args for a list input), the
    attrs to pass, and `finish(outputs, inputs)`: the op's outputs -> the program's
    (numbers), given the op's flat inputs followed by the `extra` Args' tensors (inputs
    of the program only finish reads: the keys looked up in a table the op makes)."""

    inputs: tuple
    attrs: dict = field(default_factory=dict)
    finish: Optional[Callable] = None
    extra: tuple = ()


def F(*shape, dtype="float32"):
    """A random float (or complex) input of `shape`."""
    return Arg("random", dtype, tuple(shape))


def Int(shape, high, dtype="int32"):
    """A random integer input of `shape`, values in [0, high)."""
    return Arg("random", dtype, tuple(shape), high=high)


def V(*shape, dtype="float32", value=None):
    """A variable of `shape` holding `value`, or random values (floats, or integers in
    [0, 4))."""
    return Arg("variable", dtype, tuple(shape), value,
               high=None if "float" in dtype else 4)


def G(value, dtype="int32"):
    """A given (split) input."""
    return Arg("given", dtype, np.shape(value), value)


def C(value, dtype="int32"):
    """A constant of the program."""
    return Arg("constant", dtype, np.shape(value), value)


def Made(arg: Arg, make: Callable) -> Arg:
    """`arg` turned into the op's input by `make(tensor)` inside the program."""
    return replace(arg, make=make)


def _positive_definite(batch, n):
    a = np.random.default_rng(0).standard_normal((batch, n, n))
    return (a @ np.swapaxes(a, -1, -2) + n * np.eye(n)).astype(np.float32)


C64 = "complex64"
IMAGE, VOLUME = (2, 6, 5, 3), (2, 4, 6, 4, 3)
WINDOW = {"strides": [1, 1, 1, 1], "padding": "SAME"}
POOL = {"ksize": [1, 2, 2, 1], "strides": [1, 2, 2, 1], "padding": "VALID"}
POOL3D = {"ksize": [1, 2, 2, 2, 1], "strides": [1, 2, 2, 2, 1], "padding": "VALID"}
# a 4x6 sparse tensor of three entries (int64 indices, as tf.sparse has them)
SPARSE = (C([[0, 1], [2, 3], [3, 0]], "int64"), F(3), C([4, 6], "int64"))
SORTED_IDS = C([0, 0, 1, 1, 2, 3, 3])
SCATTER = (F(4, 6), Int((3, 1), 4), F(3, 6))
# the rows of every ragged recipe: [0:2], [2:3], [3:6] of 6 values
ROW_SPLITS = [0, 2, 3, 6]


def _recipes() -> dict:
    r = {}
    r.update(dict.fromkeys(("BiasAdd", "BiasAddV1"), Recipe((F(4, 6), F(6)))))
    r["BroadcastTo"] = Recipe((F(1, 6), C([4, 6])))
    r["Fill"] = Recipe((C([4, 6]), F()))
    r["Reshape"] = Recipe((F(4, 6), C([2, 12])))
    r["Transpose"] = Recipe((F(4, 6, 2), C([1, 0, 2])))
    r["ConjugateTranspose"] = Recipe((F(4, 6, dtype=C64), C([1, 0])))
    r["Tile"] = Recipe((F(4, 6), C([2, 1])))
    r["Slice"] = Recipe((F(4, 6), C([1, 2]), C([2, 3])))
    r["Pad"] = Recipe((F(4, 6), C([[1, 0], [2, 1]])))
    r["PadV2"] = Recipe((F(4, 6), C([[1, 0], [2, 1]]), F()))
    r["MirrorPad"] = Recipe((F(4, 6), C([[1, 1], [2, 0]])), {"mode": "REFLECT"})
    r["MirrorPadGrad"] = Recipe((F(6, 9), C([[1, 1], [2, 1]])), {"mode": "REFLECT"})
    r["Reverse"] = Recipe((F(4, 6, 3), C([False, False, True], "bool")))  # the last dim
    r["ReverseV2"] = Recipe((F(4, 6, 3), C([-1])))
    r["ReverseSequence"] = Recipe((F(4, 6), G([1, 3, 6, 2], "int64")),
                                  {"seq_dim": 1, "batch_dim": 0})
    r["SplitV"] = Recipe((F(4, 6), C([2, 4]), C(1)), {"num_split": 2})
    r["StridedSliceGrad"] = Recipe((C([4, 6]), C([1, 0]), C([4, 6]), C([1, 2]), F(3, 3)))
    r["Cast"] = Recipe((F(4, 6),), {"DstT": "int32"})
    r["EnsureShape"] = Recipe((F(4, 6),), {"shape": [4, 6]})
    r["PlaceholderWithDefault"] = Recipe((F(4, 6),), {"shape": [4, 6]})
    r["DynamicPartition"] = Recipe((F(6, 4), Int((6,), 2)), {"num_partitions": 2})
    r["ApproxTopK"] = Recipe((F(4, 6),), {"k": 3})
    r["Einsum"] = Recipe(([F(4, 6), F(6, 5)],), {"equation": "ij,jk->ik"})
    r["BatchMatMulV3"] = Recipe((F(2, 4, 6), F(2, 6, 5)), {"Tout": "float32"})
    r["AccumulateNV2"] = Recipe(([F(4, 6), F(4, 6)],), {"shape": [4, 6]})
    r["IdentityN"] = Recipe(([F(4, 6), Int((4, 6), 4)],))
    r["InvertPermutation"] = Recipe((G([3, 0, 5, 1, 4, 2]),))
    r["LinSpace"] = Recipe((F(), C(2.0, "float32"), C(7)))
    # gathers and scatters
    r["GatherNd"] = Recipe((F(4, 6), Int((5, 1), 4)))
    r["ScatterNd"] = Recipe((Int((5, 1), 4), F(5, 6), C([4, 6])))
    r["ScatterNdNonAliasingAdd"] = Recipe(SCATTER)
    for op in ("TensorScatterAdd", "TensorScatterSub", "TensorScatterMax",
               "TensorScatterMin"):
        r[op] = Recipe(SCATTER)
    # distinct indices: an update of one row twice keeps either value
    r["TensorScatterUpdate"] = Recipe((F(4, 6), G([[2], [0], [3]]), F(3, 6)))
    r["OneHot"] = Recipe((Int((4, 6), 5), C(5), C(1.0, "float32"), C(0.0, "float32")))
    # segments
    for op in ("Sum", "Max", "Min", "Prod"):
        r["UnsortedSegment" + op] = Recipe((F(6, 5), Int((6,), 4), C(4)))
    for op in ("Sum", "Mean", "SqrtN"):
        r["SparseSegment" + op] = Recipe((F(5, 6), Int((7,), 5), SORTED_IDS))
        r[f"SparseSegment{op}WithNumSegments"] = Recipe(
            (F(5, 6), Int((7,), 5), SORTED_IDS, C(5)))
    # images and volumes
    r["Conv2D"] = Recipe((F(*IMAGE), F(3, 3, 3, 4)), WINDOW)
    r["Conv2DBackpropInput"] = Recipe((C(IMAGE), F(3, 3, 3, 4), F(2, 6, 5, 4)), WINDOW)
    r["Conv2DBackpropFilter"] = Recipe((F(*IMAGE), C([3, 3, 3, 4]), F(2, 6, 5, 4)), WINDOW)
    r["DepthwiseConv2dNative"] = Recipe((F(*IMAGE), F(3, 3, 3, 2)), WINDOW)
    r["DepthwiseConv2dNativeBackpropInput"] = Recipe(
        (C(IMAGE), F(3, 3, 3, 2), F(2, 6, 5, 6)), WINDOW)
    r["DepthwiseConv2dNativeBackpropFilter"] = Recipe(
        (F(*IMAGE), C([3, 3, 3, 2]), F(2, 6, 5, 6)), WINDOW)
    window3d = {"strides": [1] * 5, "padding": "SAME"}
    r["Conv3D"] = Recipe((F(*VOLUME), F(2, 3, 3, 3, 4)), window3d)
    r["Conv3DBackpropInputV2"] = Recipe((C(VOLUME), F(2, 3, 3, 3, 4), F(2, 4, 6, 4, 4)),
                                        window3d)
    r["Conv3DBackpropFilterV2"] = Recipe((F(*VOLUME), C([2, 3, 3, 3, 4]),
                                          F(2, 4, 6, 4, 4)), window3d)
    r["Dilation2D"] = Recipe((F(*IMAGE), F(2, 2, 3)),
                             {"strides": [1, 1, 1, 1], "rates": [1, 1, 1, 1],
                              "padding": "SAME"})
    r["AvgPool3D"] = Recipe((F(*VOLUME),), POOL3D)
    r["MaxPool3D"] = Recipe((F(*VOLUME),), POOL3D)
    r["AvgPool3DGrad"] = Recipe((C(VOLUME), F(2, 2, 3, 2, 3)), POOL3D)
    r["MaxPool3DGrad"] = Recipe((F(*VOLUME), F(2, 2, 3, 2, 3), F(2, 2, 3, 2, 3)), POOL3D)
    r["MaxPool3DGradGrad"] = Recipe((F(*VOLUME), F(2, 2, 3, 2, 3), F(*VOLUME)), POOL3D)
    r["AvgPoolGrad"] = Recipe((C([2, 6, 4, 3]), F(2, 3, 2, 3)), POOL)
    r["MaxPoolV2"] = Recipe((F(2, 6, 4, 3), C([1, 2, 2, 1]), C([1, 2, 2, 1])),
                            {"padding": "VALID"})
    r["MaxPoolGradV2"] = Recipe((F(2, 6, 4, 3), F(2, 3, 2, 3), F(2, 3, 2, 3),
                                 C([1, 2, 2, 1]), C([1, 2, 2, 1])), {"padding": "VALID"})
    r["DepthToSpace"] = Recipe((F(2, 3, 5, 8),), {"block_size": 2})
    r["SpaceToBatchND"] = Recipe((F(2, 4, 6, 3), C([2, 2]), C([[0, 0], [0, 0]])))
    r["BatchToSpaceND"] = Recipe((F(8, 2, 3, 3), C([2, 2]), C([[0, 0], [0, 0]])))
    r["SpaceToBatch"] = Recipe((F(2, 4, 6, 3), C([[0, 0], [0, 0]])), {"block_size": 2})
    r["BatchToSpace"] = Recipe((F(8, 2, 3, 3), C([[0, 0], [0, 0]])), {"block_size": 2})
    r["ExtractImagePatches"] = Recipe((F(*IMAGE),), {"ksizes": [1, 2, 2, 1], "padding": "VALID",
                                                      "strides": [1] * 4, "rates": [1] * 4})
    r["ExtractVolumePatches"] = Recipe((F(*VOLUME),), {"ksizes": [1, 2, 2, 2, 1],
                                                        "strides": [1] * 5,
                                                        "padding": "VALID"})
    r["CropAndResize"] = Recipe((F(*IMAGE), C([[0, 0, 1, 1], [0.1, 0.2, 0.8, 0.9]],
                                              "float32"), C([0, 1]), C([3, 4])))
    r["ScaleAndTranslate"] = Recipe((F(*IMAGE), C([8, 7]), C([1.3, 1.4], "float32"),
                                     C([0.0, 0.0], "float32")))
    # normalization
    channels = (F(3), F(3))
    r["FusedBatchNorm"] = Recipe((F(2, 4, 6, 3), *channels, F(0), F(0)))
    for op in ("FusedBatchNormV2", "FusedBatchNormV3"):
        r[op] = Recipe((F(2, 4, 6, 3), *channels, F(0), F(0)))
    r["DrawBoundingBoxes"] = Recipe((F(*IMAGE), C([[[0.1, 0.1, 0.6, 0.7]],
                                                   [[0.2, 0.3, 0.9, 0.8]]], "float32")))
    r["ExtractGlimpse"] = Recipe((F(*IMAGE), C([3, 3]), C([[0, 0], [0.1, 0.2]], "float32")))
    transform = C([[1, 0, 0.5, 0, 1, 0.3, 0, 0]], "float32")
    r["ImageProjectiveTransformV2"] = Recipe((F(*IMAGE), transform, C([6, 5])),
                                             {"interpolation": "BILINEAR"})
    r["ImageProjectiveTransformV3"] = Recipe((F(*IMAGE), transform, C([6, 5]),
                                              C(0.0, "float32")), {"interpolation": "BILINEAR"})
    # sequences: time 5, batch 2, 4 classes (CTC's blank the last), LSTM cells of 5
    ctc = (F(5, 2, 4), C([[0, 0], [0, 1], [1, 0]], "int64"), C([1, 2, 1]), C([5, 4]))
    r["CTCLoss"] = Recipe(ctc)
    lstm = (C(3, "int64"), F(3, 2, 4), F(2, 5), F(2, 5), F(9, 20), F(5), F(5), F(5), F(20))
    r["BlockLSTM"] = Recipe(lstm)
    r["BlockLSTMV2"] = Recipe(lstm)
    # stateless random numbers: the same seed gives the same numbers on every device
    seed = C([1, 2], "int64")
    r["StatelessMultinomial"] = Recipe((F(4, 6), C(3), seed))
    r["StatelessRandomUniformInt"] = Recipe((C([4, 6]), seed, C(0), C(10)))
    r["StatelessRandomGammaV2"] = Recipe((C([4, 6]), seed, G(np.full(6, 2.0), "float32")))
    r["StatelessRandomPoisson"] = Recipe((C([4, 6]), seed, G(np.full(6, 3.0), "float32")),
                                         {"dtype": "int32"})
    r["StatelessRandomBinomial"] = Recipe((C([4, 6]), seed, G(np.full((4, 6), 5.0), "float32"),
                                           G(np.full((4, 6), 0.3), "float32")))
    r["StatelessParameterizedTruncatedNormal"] = Recipe(
        (C([4, 6]), seed, F(6), G(np.ones(6), "float32"), G(np.full(6, -2.0), "float32"),
         G(np.full(6, 2.0), "float32")))
    # linear algebra
    r["MatrixSetDiag"] = Recipe((F(4, 6), F(4)))
    r.update(dict.fromkeys(("MatrixSetDiagV2", "MatrixSetDiagV3"), Recipe((F(4, 6), F(4), C(0)))))
    for op in ("MatrixDiagPartV2", "MatrixDiagPartV3"):
        r[op] = Recipe((F(3, 4, 6), C(0), C(0.0, "float32")))
    for op in ("MatrixDiagV2", "MatrixDiagV3"):
        r[op] = Recipe((F(4, 6), C(0), C(-1), C(-1), C(0.0, "float32")))
    r["Cholesky"] = Recipe((G(_positive_definite(3, 4), "float32"),))
    batch = G(_positive_definite(8, 3).reshape(4, 2, 3, 3), "float32")  # 2 batch dims split
    r.update(MatrixInverse=Recipe((batch,)), MatrixSquareRoot=Recipe((batch,)),
             MatrixSolve=Recipe((batch, F(4, 2, 3, 2))), Qr=Recipe((F(4, 2, 3, 5),)),
             MatrixTriangularSolve=Recipe((batch, F(4, 2, 3, 2))))
    r["MatrixSolveLs"] = Recipe((F(4, 6, 3), F(4, 6, 2), C(0.1, "float64")))
    r["TridiagonalSolve"] = Recipe((F(4, 3, 6), F(4, 6, 2)))
    r["Eig"] = Recipe((F(3, 4, 4),), {"Tout": C64})
    r["TridiagonalMatMul"] = Recipe((F(4, 1, 6), F(4, 1, 6), F(4, 1, 6), F(4, 6, 3)))
    # complex values and transforms
    for op in ("Real", "Imag", "Angle", "Conj", "ComplexAbs", "FFT", "IFFT"):
        r[op] = Recipe((F(4, 6, dtype=C64),))
    r.update(dict.fromkeys(("FFT2D", "IFFT2D"), Recipe((F(2, 4, 6, dtype=C64),))))
    r.update(dict.fromkeys(("FFT3D", "IFFT3D"), Recipe((F(2, 3, 4, 6, dtype=C64),))))
    r["RFFT"] = Recipe((F(4, 6), C([6])))
    r["RFFT2D"] = Recipe((F(2, 4, 6), C([4, 6])))
    r["IRFFT"] = Recipe((F(4, 4, dtype=C64), C([6])))
    r["IRFFT2D"] = Recipe((F(2, 4, 4, dtype=C64), C([4, 6])))
    # quantization
    limits = (C(-1.0, "float32"), C(1.0, "float32"))
    r["FakeQuantWithMinMaxVars"] = Recipe((F(4, 6), *limits))
    r["FakeQuantWithMinMaxVarsGradient"] = Recipe((F(4, 6), F(4, 6), *limits))
    r["FakeQuantWithMinMaxVarsPerChannel"] = Recipe((F(4, 6), C(-np.ones(6), "float32"),
                                                     C(np.linspace(0.5, 1, 6), "float32")))
    r["QuantizeAndDequantizeV2"] = Recipe((F(4, 6), *limits))
    r["QuantizeAndDequantizeV3"] = Recipe((F(4, 6), *limits, C(8)))
    r["QuantizeAndDequantizeV4"] = Recipe((F(4, 6), *limits))
    r["QuantizeAndDequantizeV4Grad"] = Recipe((F(4, 6), F(4, 6), *limits))
    # sparse tensors against dense ones
    r["SparseTensorDenseMatMul"] = Recipe((*SPARSE, F(6, 5)))
    r["SparseTensorDenseAdd"] = Recipe((*SPARSE, F(4, 6)))
    for op in ("Add", "Mul", "Div"):
        r["SparseDenseCwise" + op] = Recipe((*SPARSE, F(4, 6)))
    r["SparseToDense"] = Recipe((C([[0, 1], [2, 3]]), C([4, 6]), F(2), F()))
    r["SparseReduceSum"] = Recipe((*SPARSE, C([1])))
    r["SparseSoftmax"] = Recipe(SPARSE)
    r["SparseReorder"] = Recipe(SPARSE)
    r["SparseFillEmptyRows"] = Recipe((*SPARSE, F()))
    r["SparseAdd"] = Recipe((*SPARSE, *SPARSE, C(0.0, "float32")))
    r["SparseSparseMaximum"] = Recipe((*SPARSE, *SPARSE))
    r["SparseSparseMinimum"] = Recipe((*SPARSE, *SPARSE))
    r["SparseSlice"] = Recipe((*SPARSE, C([0, 0], "int64"), C([2, 6], "int64")))
    r["SparseAddGrad"] = Recipe((F(3), C([[0, 1], [2, 3]], "int64"), C([[1, 1]], "int64"),
                                 C([[0, 1], [1, 1], [2, 3]], "int64")))
    r.update(_stateless_random())
    r.update(_strings())
    r.update(_tensor_lists())
    r.update(_csr_matrices())
    r.update(_images_and_sequences())
    r.update(_given_attrs())
    return r


def _stateless_random() -> dict:
    """Stateless random numbers of a (key, counter, algorithm): the same on every device."""
    key, counter, philox = C([7], "uint64"), C([0, 3], "uint64"), C(1)
    r = {op: Recipe((C([4, 6]), key, counter, philox))
         for op in ("StatelessRandomUniformV2", "StatelessRandomNormalV2",
                    "StatelessTruncatedNormalV2", "StatelessRandomUniformFullIntV2")}
    r["StatelessRandomUniformIntV2"] = Recipe((C([4, 6]), key, counter, philox, C(0), C(10)))
    r["StatelessRandomGammaV3"] = Recipe((C([4, 6]), key, counter, philox,
                                          G(np.full(6, 2.0), "float32")))
    r["RandomIndexShuffle"] = Recipe((G(np.arange(6) * 7, "int64"), C([1, 2, 3], "int64"),
                                      C(99, "int64")))
    return r


def _as_string(t):
    return tf.strings.as_string(t, precision=3)


def _strings() -> dict:
    """String ops on strings made from split numbers (tf.strings.as_string)."""
    text = Made(F(4, 6), _as_string)
    r = {op: Recipe((text,), {"num_buckets": 10})
         for op in ("StringToHashBucketFast", "StringToHashBucket")}
    r["StringToHashBucketStrong"] = Recipe((text,), {"num_buckets": 10, "key": [1, 2]})
    r["StringToNumber"] = Recipe((text,))
    r["StringJoin"] = Recipe(([text, Made(F(4, 6), _as_string)],), {"separator": "+"})
    r["RegexReplace"] = Recipe((text, C(r"\.", "object"), C("_", "object")))
    r["EncodeBase64"] = Recipe((text,))
    r["DecodeBase64"] = Recipe((Made(F(4, 6), lambda t: tf.io.encode_base64(
        _as_string(t))),))
    r["ReduceJoin"] = Recipe((text, C(1)))
    r["StringSplit"] = Recipe((Made(F(6), _as_string), C(".", "object")))
    return r


def _fixed_width(t):
    """t's numbers as strings of 12 bytes each."""
    return tf.strings.as_string(t, precision=3, width=12)


def _given_attrs() -> dict:
    """Ops whose attrs have no default (given here), sets, ragged tensors, bytes and
    optionals."""
    splits, values = [C(ROW_SPLITS, "int64")], F(6)
    sparse_ints = (SPARSE[0], G([1, 2, 3]), SPARSE[2])
    r = {"TopK": Recipe((F(4, 6),), {"k": 3}),
         "Bitcast": Recipe((F(4, 6),), {"type": "int32"}),
         "Const": Recipe((), {"value": tf.make_tensor_proto(
             np.arange(24, dtype=np.float32).reshape(4, 6)), "dtype": "float32"}),
         "BatchNormWithGlobalNormalization": Recipe(
             (F(2, 4, 6, 3), F(3), G([0.5, 1.5, 2.0], "float32"), F(3), F(3)),
             {"variance_epsilon": 1e-3, "scale_after_normalization": True}),
         "CTCBeamSearchDecoder": Recipe((F(5, 2, 4), C([5, 4])),
                                        {"beam_width": 3, "top_paths": 1}),
         "CTCLossV2": Recipe((F(5, 2, 4), C([[0, 0], [0, 1], [1, 0]], "int64"),
                              C([1, 2, 1]), C([5, 4]))),
         "ConcatOffset": Recipe((C(1), [C([4, 2]), C([4, 3])])),
         "SparseConcat": Recipe(([SPARSE[0], SPARSE[0]], [F(3), F(3)],
                                 [SPARSE[2], SPARSE[2]]), {"concat_dim": 1}),
         "DenseToDenseSetOperation": Recipe((Int((4, 6), 5), Int((4, 6), 5)),
                                            {"set_operation": "intersection"}),
         "DenseToSparseSetOperation": Recipe((Int((4, 6), 5), *sparse_ints),
                                             {"set_operation": "union"}),
         "SparseToSparseSetOperation": Recipe((*sparse_ints, *sparse_ints),
                                              {"set_operation": "a-b"}),
         "SetSize": Recipe(sparse_ints),
         "RaggedGather": Recipe((splits, values, Int((4,), 3)), {"OUTPUT_RAGGED_RANK": 1}),
         "RaggedTensorToTensor": Recipe((C([3, 4], "int64"), values, C(0.0, "float32"),
                                         splits), {"row_partition_types": ["ROW_SPLITS"]}),
         "RaggedTensorToSparse": Recipe((splits, values)),
         "RaggedFillEmptyRows": Recipe((C([0, 0, 2, 2, 2, 3], "int64"), values, C(5, "int64"),
                                        C(0.0, "float32"))),
         "RaggedTensorToVariant": Recipe((splits, values), {"batched_input": False},
                                         finish=_from_variant),
         "RaggedTensorFromVariant": Recipe((Made(values, _to_variant),), _FROM_VARIANT,
                                           finish=lambda outs, _: shaped(
                                               [*outs[0], outs[1]], [4], [6])),
         "DecodeRaw": Recipe((Made(F(4, 6), _fixed_width),), {"out_type": "uint8"},
                             finish=lambda out, _: shaped([out], [4, 6, 12])[0]),
         "DecodePaddedRaw": Recipe((Made(F(4, 6), _fixed_width), C(16)),
                                   {"out_type": "uint16"}),
         "ParseTensor": Recipe((Made(F(4, 6), tf.io.serialize_tensor),), {"out_type": "float32"},
                               finish=lambda out, _: shaped([out], [4, 6])[0]),
         "SdcaFprint": Recipe((Made(F(6), _as_string),)),
         "EncodeProto": Recipe((C([[1]] * 4), [Int((4, 1), 9, "int64")]), _DIM_PROTO),
         "DecodeProtoV2": Recipe((Made(Int((4, 1), 9, "int64"), _encoded_dims),),
                                 dict(_DIM_PROTO, output_types=[tf.int64]),
                                 finish=lambda outs, _: shaped([outs[0], *outs[1]],
                                                               [4, 1], [4, 1])),
         "CompositeTensorVariantFromComponents": Recipe(
             ([values, splits[0]],), {"metadata": _RAGGED_SPEC}, finish=_ragged_components),
         "CompositeTensorVariantToComponents": Recipe(
             (Made(values, _composite_variant),),
             {"metadata": _RAGGED_SPEC, "Tcomponents": [tf.float32, tf.int64]},
             finish=lambda outs, _: shaped(list(outs), [6], [4])),
         "OptionalFromValue": Recipe(([F(4, 6)],), finish=_optional_value),
         "OptionalGetValue": Recipe((Made(F(4, 6), lambda t: tf.raw_ops.OptionalFromValue(
             components=[t])),), {"output_types": [tf.float32], "output_shapes": [[4, 6]]})}
    return r


# the size field of TensorShapeProto.Dim (a message TF's own protos define)
_DIM_PROTO = {"field_names": ["size"], "message_type": "tensorflow.TensorShapeProto.Dim"}


def _encoded_dims(sizes):
    """Serialized TensorShapeProto.Dim messages of `sizes` ((n, 1) int64)."""
    return tf.raw_ops.EncodeProto(sizes=tf.ones(sizes.shape, tf.int32), values=[sizes],
                                  **_DIM_PROTO)


def _optional_value(optional, _inputs=()):
    return tf.raw_ops.OptionalGetValue(optional=optional, output_types=[tf.float32],
                                       output_shapes=[[4, 6]])


_FROM_VARIANT = {"input_ragged_rank": 1, "output_ragged_rank": 1, "Tvalues": tf.float32,
                 "Tsplits": tf.int64}


# a RaggedTensorSpec of 3 rows of float32 (int64 splits), serialized as the metadata attr
# of the CompositeTensorVariant ops (what tf.function's composite arguments carry)
_RAGGED_SPEC = nested_structure_coder.encode_structure(tf.RaggedTensorSpec(
    [3, None], tf.float32, 1, tf.int64)).type_spec_value.SerializeToString()


def _composite_variant(values):
    """A ragged tensor of rows [0:2], [2:3], [3:6] of `values`, as a composite variant."""
    return tf.raw_ops.CompositeTensorVariantFromComponents(
        components=[values, tf.constant(ROW_SPLITS, tf.int64)], metadata=_RAGGED_SPEC)


def _ragged_components(variant, _inputs=()):
    """A composite ragged variant's values and splits (of 6 floats)."""
    return shaped(tf.raw_ops.CompositeTensorVariantToComponents(
        encoded=variant, metadata=_RAGGED_SPEC, Tcomponents=[tf.float32, tf.int64]), [6], [4])


def _to_variant(values):
    """A ragged tensor of rows [0:2], [2:3], [3:6] of `values`, as a variant."""
    return tf.raw_ops.RaggedTensorToVariant(rt_nested_splits=[tf.constant(ROW_SPLITS,
                                                                          tf.int64)],
                                            rt_dense_values=values, batched_input=False)


def _from_variant(variant, _inputs=()):
    """A ragged variant's splits and values (of 6 floats)."""
    splits, values = tf.raw_ops.RaggedTensorFromVariant(encoded_ragged=variant,
                                                        **_FROM_VARIANT)
    return shaped([*splits, values], [4], [6])


def _list_of(t):
    """A TensorList of t's rows."""
    return tf.raw_ops.TensorListFromTensor(tensor=t, element_shape=tf.constant([6]))


def _stacked(count, shape=(6,)):
    """The function stacking a float32 TensorList of `count` elements of `shape` (the
    count given, as TF's shape inference does not know a list's length)."""
    def stack(handle, _inputs=()):
        return tf.raw_ops.TensorListStack(
            input_handle=handle, element_shape=tf.constant(list(shape)),
            element_dtype=tf.float32, num_elements=count)
    return stack


def _tensor_lists() -> dict:
    """TensorList ops (tf.while_loop's accumulators) on lists of a split tensor's rows,
    lists returned stacked."""
    listed, element = Made(F(4, 6), _list_of), C([6])
    dtype = {"element_dtype": "float32"}
    r = {"TensorListFromTensor": Recipe((F(4, 6), element), finish=_stacked(4)),
         "TensorListStack": Recipe((listed, element), dict(dtype, num_elements=4)),
         "TensorListGetItem": Recipe((listed, C(2), element), dtype),
         "TensorListSetItem": Recipe((listed, C(1), F(6)), finish=_stacked(4)),
         "TensorListGather": Recipe((listed, C([3, 0]), element), dtype),
         "TensorListScatter": Recipe((F(3, 6), C([2, 0, 1]), element),
                                     finish=_stacked(3)),
         "TensorListScatterV2": Recipe((F(3, 6), C([2, 0, 1]), element, C(3)),
                                       finish=_stacked(3)),
         "TensorListScatterIntoExistingList": Recipe((listed, F(2, 6), C([3, 1])),
                                                     finish=_stacked(4)),
         "TensorListLength": Recipe((listed,)),
         "TensorListElementShape": Recipe((listed,), {"shape_type": "int32"}),
         "TensorListPushBack": Recipe((listed, F(6)), finish=_stacked(5)),
         "TensorListPushBackBatch": Recipe((Made(F(2, 6), _lists_of_rows), F(2, 6)),
                                           finish=_each_stacked),
         "TensorListPopBack": Recipe((listed, element), dtype,
                                     finish=lambda outs, _: (_stacked(3)(outs[0]), outs[1])),
         "TensorListResize": Recipe((listed, C(3)), finish=_stacked(3)),
         "TensorListSplit": Recipe((F(4, 6), C([-1, 6]), C([2, 2], "int64")),
                                   finish=_stacked(2, (2, 6))),
         "EmptyTensorList": Recipe((element, C(4)), dtype, finish=_pushed, extra=(F(6),)),
         "TensorListReserve": Recipe((element, C(4)), dtype, finish=_stacked(4)),
         "TensorListConcat": Recipe((listed,), dict(dtype, element_shape=tf.TensorShape(
             [None])), finish=_concatenated),
         "TensorListConcatV2": Recipe((listed, C([-1]), C(np.zeros(0), "int64")), dtype,
                                      finish=_concatenated),
         "TensorListConcatLists": Recipe((listed, listed), dtype, finish=_stacked(8))}
    return r


def _lists_of_rows(t):
    """A batch (a vector) of TensorLists, each holding one row of t."""
    return tf.stack([_list_of(t[i:i + 1]) for i in range(t.shape[0])])


def _each_stacked(handles, _inputs=()):
    """A batch of TensorLists of two elements of (6,) each, stacked: (batch, 2, 6)."""
    return tf.stack([_stacked(2)(handles[i]) for i in range(handles.shape[0])])


def _pushed(handle, inputs):
    """A Recipe.finish: the extra input pushed onto the op's list, the list stacked."""
    pushed = tf.raw_ops.TensorListPushBack(input_handle=handle, tensor=inputs[-1])
    return _stacked(1)(pushed)


def _concatenated(outputs, _inputs=()):
    """A Recipe.finish: a list of four rows of 6 concatenated, and its lengths."""
    return shaped(outputs, [24], [4])


def shaped(tensors, *shapes):
    """`tensors` given `shapes` (which TF's shape inference leaves unknown)."""
    for t, shape in zip(tensors, shapes):
        t.set_shape(shape)
    return tensors


def _csr(t):
    """A CSR sparse matrix of t's (4, 6) entries at three fixed positions."""
    return tf.raw_ops.DenseToCSRSparseMatrix(
        dense_input=t, indices=tf.constant([[0, 1], [2, 3], [3, 0]], tf.int64))


def _dense(matrix, _inputs=()):
    """A float32 CSR sparse matrix's dense value."""
    return tf.raw_ops.CSRSparseMatrixToDense(sparse_input=matrix, type=tf.float32)


def _csr_matrices() -> dict:
    """CSR sparse matrix ops (tf.linalg.sparse) on matrices made of split dense ones."""
    csr = Made(F(4, 6), _csr)
    f32 = {"type": "float32"}
    return {
        "DenseToCSRSparseMatrix": Recipe((F(4, 6), C([[0, 1], [2, 3], [3, 0]], "int64")),
                                         finish=_dense),
        "SparseTensorToCSRSparseMatrix": Recipe(SPARSE, finish=_dense),
        "CSRSparseMatrixToDense": Recipe((csr,), f32),
        "CSRSparseMatrixToSparseTensor": Recipe((csr,), f32),
        "SparseMatrixNNZ": Recipe((csr,)),
        "SparseMatrixTranspose": Recipe((csr,), f32, finish=_dense),
        "SparseMatrixMatMul": Recipe((csr, F(6, 5))),
        "SparseMatrixSparseMatMul": Recipe((csr, Made(F(6, 4), _csr_of_transposed)), f32,
                                           finish=_dense),
        "SparseMatrixZeros": Recipe((C([4, 6], "int64"),), f32, finish=_dense),
        "SparseMatrixAdd": Recipe((csr, csr, C(1.0, "float32"), C(2.0, "float32")),
                                  finish=_dense),
        "SparseMatrixMul": Recipe((csr, F()), finish=_dense),
        "SparseMatrixSoftmax": Recipe((csr,), f32, finish=_dense)}


def _csr_of_transposed(t):
    """A CSR sparse matrix of t's (6, 4) transposed entries: the (4, 6) positions of _csr
    transposed."""
    return tf.raw_ops.DenseToCSRSparseMatrix(
        dense_input=t, indices=tf.constant([[1, 0], [3, 2], [0, 3]], tf.int64))


def _images_and_sequences() -> dict:
    """Image ops of boxes and scores, fractional pools, the batch-norm gradients, CTC
    decoding and edit distance."""
    boxes, scores = G(np.array([[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, -0.1, 1, 0.9],
                                [0, 10, 1, 11], [0, 10.1, 1, 11.1], [0, 100, 1, 101]],
                               np.float32), "float32"), F(6)
    r = {"NonMaxSuppression": Recipe((boxes, scores, C(3))),
         "NonMaxSuppressionV2": Recipe((boxes, scores, C(3), C(0.5, "float32"))),
         "NonMaxSuppressionWithOverlaps": Recipe(
             (F(6, 6), scores, C(3), C(0.5, "float32"), C(-10.0, "float32"))),
         "FractionalMaxPool": Recipe((F(*IMAGE),), _FRACTIONAL),
         "FractionalAvgPool": Recipe((F(*IMAGE),), _FRACTIONAL),
         "CTCGreedyDecoder": Recipe((F(5, 2, 4), C([5, 4]))),
         "EditDistance": Recipe((C([[0, 0], [0, 1], [1, 0]], "int64"), G([1, 2, 1]),
                                 C([2, 2], "int64"), C([[0, 0], [1, 0], [1, 1]], "int64"),
                                 G([1, 3, 1]), C([2, 2], "int64"))),
         "Range": Recipe((C(0), C(10), C(3)))}
    variance = G(np.array([0.5, 1.5, 2.0]), "float32")
    for op in ("FusedBatchNormGrad", "FusedBatchNormGradV2"):
        r[op] = Recipe((F(2, 4, 6, 3), F(2, 4, 6, 3), F(3), F(3), variance))
    r["FusedBatchNormGradV3"] = Recipe((F(2, 4, 6, 3), F(2, 4, 6, 3), F(3), F(3), variance,
                                        F(0)))
    return r


# pooling_ratio per dim and fixed seeds: deterministic pooling regions
_FRACTIONAL = {"pooling_ratio": [1.0, 1.5, 1.25, 1.0], "seed": 1, "seed2": 2,
               "deterministic": True}


RECIPES = _recipes()
