"""The rule builders, one module per op family, and the record they build.

Each builder takes a RuleContext (and its parameters from the op registry) and returns
an OpRule, or None when the instance has no rule (the op then runs replicated). This
package is the namespace users write rules with (gt.register_op): the record and core
builders (gspmd_tf/propagation/oprule.py) and every family's builders:

  dense        elementwise, contractions (MatMul, Einsum), biases, sources, updates
  reductions   reductions, arg-reductions, segment sums, cumulative ops
  reshapes     Transpose, Reshape (sub-factors), ExpandDims/Squeeze, Bitcast
  slices       Slice, StridedSlice(Grad), Pad, Tile, ConcatV2 (windows: halos)
  indexing     gathers, scatters, OneHot, Roll
  structure    Split, Pack/Unpack, FusedBatchNorm, TensorList ops
  batched      ops mixing their last dims (linear algebra, FFTs, images), whole-input ops

Windowed ops (convolutions, pooling, MirrorPad) are in gspmd_tf/propagation/windowed.py.
Which builder serves each op type is the op registry's (gspmd_tf/registry.py).
"""

from gspmd_tf.propagation.oprule import (OpRule, PASS, REDUCE, REPLICATE, RuleContext,
                                         SpatialDim, einsum_rule, equation_rule, per_dim)
from gspmd_tf.propagation.rules.dense import (batch_matmul, bias_add, bias_add_grad,
                                              broadcast_to, cross_entropy, einsum, elementwise,
                                              last_dim_normalizer, matmul, select_v1, source,
                                              variable_update)
from gspmd_tf.propagation.rules.reductions import (ReductionParams, arg_reduction, cumulative,
                                                   last_dims_whole, reduction, unsorted_segment)
from gspmd_tf.propagation.rules.reshapes import (bitcast, merge_dims, reshape, reshape_factors,
                                                 squeeze_or_expand, transpose)
from gspmd_tf.propagation.rules.slices import (SliceParams, changed_dims, concat, pad_or_slice,
                                               same_rank_slicing, strided_slice,
                                               strided_slice_grad, tile)
from gspmd_tf.propagation.rules.indexing import (GatherParams, RollParams, gather, gather_nd,
                                                 one_hot, resource_scatter, roll,
                                                 scatter_nd)
from gspmd_tf.propagation.rules.structure import (BatchNormParams, TensorListParams,
                                                  fused_batch_norm, pack, split,
                                                  tensor_list, unpack)

__all__ = ["BatchNormParams", "GatherParams", "OpRule", "PASS", "REDUCE", "REPLICATE",
           "ReductionParams", "RollParams", "RuleContext", "SliceParams", "SpatialDim",
           "TensorListParams", "arg_reduction", "batch_matmul", "bias_add", "bias_add_grad",
           "bitcast", "broadcast_to", "changed_dims", "concat", "cross_entropy", "cumulative",
           "einsum", "einsum_rule", "elementwise", "equation_rule", "fused_batch_norm", "gather",
           "gather_nd", "last_dim_normalizer", "last_dims_whole", "matmul",
           "merge_dims", "one_hot", "pack", "pad_or_slice", "per_dim", "reduction", "reshape",
           "reshape_factors", "resource_scatter", "roll", "same_rank_slicing", "scatter_nd",
           "select_v1", "source",
           "split", "squeeze_or_expand", "strided_slice", "strided_slice_grad", "tensor_list",
           "tile", "transpose", "unpack", "unsorted_segment", "variable_update"]
