"""A GShard mixture-of-experts layer, written as plain single-device TF code.

    from gspmd_tf import moe
    y, aux_loss = moe.moe_layer(x, wg, w_in, w_out, k=2, capacity_factor=1.0,
                                mesh=mesh, specs=moe.MoeSpecs(...))

x is [G, S, M]: G groups of S tokens of width M (GShard, Lepikhin et al. 2020, section
2.2). Each group routes its tokens on its own: softmax gating over E experts, each token
sent to its top-k experts (ArgMax for k = 1, TopKV2 otherwise); a token's position in an
expert's buffer is the number of tokens routed there before it in its group (first
choices before second choices, a Cumsum over the group's tokens), and tokens past the
expert's capacity C = ceil(k * S * capacity_factor / E) are dropped (they contribute
nothing; the residual connection, if any, is the caller's). Then

    dispatched = einsum("GSEC,GSM->EGCM", dispatch_mask, x)
    h          = relu(einsum("EGCM,EMH->EGCH", dispatched, w_in))
    expert_out = einsum("EGCH,EHM->EGCM", h, w_out)
    y          = einsum("GSEC,EGCM->GSM", combine_weights, expert_out)

With `mesh` and `specs` the layer annotates as GShard does: x, y and the dispatch mask and
combine weights split on G, the expert weights split on E, the dispatched tensor and the
expert output split on E (and on G over any remaining axes). The partitioner then turns
the dispatch and the combine into all-to-alls that move the split from G to E and back
(docs/DESIGN_LOG.md, "Mixture of experts"). Without them the same code runs on one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tensorflow as tf

from gspmd_tf.annotations import mesh_split
from gspmd_tf.mesh import PartitionSpec as P


@dataclass(frozen=True)
class MoeSpecs:
    """PartitionSpecs of the layer's tensors (GShard's annotations).

    groups:  x, y and every per-token tensor [G, S, ...]: G split, e.g. P("expert") or
             P(("data", "expert"))
    experts: w_in [E, M, H] and w_out [E, H, M]: E split, e.g. P("expert")
    expert_buffers: the dispatched tensor and the expert output [E, G, C, M]: E split, G
             on any axes left, e.g. P("expert") or P("expert", "data")
    hidden:  a mesh axis splitting each expert's hidden dim H (model parallelism inside
             the experts, Megatron-style: w_in's columns, w_out's rows and the hidden
             activations [E, G, C, H]), or None
    """

    groups: P
    experts: P
    expert_buffers: P
    hidden: str | None = None

    def on_hidden(self, spec, hidden_dim):
        """`spec` with dim `hidden_dim` split over the hidden axis (unchanged without)."""
        if self.hidden is None:
            return spec
        entries = list(spec)[:hidden_dim]
        return P(*(entries + [None] * (hidden_dim - len(entries)) + [self.hidden]))


def capacity(tokens_per_group, num_experts, k, capacity_factor):
    """Tokens one expert takes from one group: ceil(k * S * capacity_factor / E)."""
    return max(1, math.ceil(k * tokens_per_group * capacity_factor / num_experts))


def top_k_gating(logits, k, expert_capacity):
    """GShard's gating of logits [G, S, E]: (dispatch_mask, combine_weights), each
    [G, S, E, C], and the load-balancing loss (a scalar).

    dispatch_mask[g, s, e, c] is 1 where token s of group g goes to slot c of expert e;
    combine_weights is that times the token's gate for the expert (top-k gates
    renormalized to sum to 1 when k > 1, as GShard's top-2 does).
    """
    num_experts = logits.shape[-1]
    probs = tf.nn.softmax(logits, axis=-1)
    if k == 1:
        choices = tf.expand_dims(tf.math.argmax(probs, axis=-1, output_type=tf.int32), -1)
    else:
        _, choices = tf.math.top_k(probs, k=k)
    masks = tf.one_hot(choices, num_experts, dtype=probs.dtype)           # [G, S, k, E]
    gates = tf.reduce_sum(tf.expand_dims(probs, 2) * masks, axis=-1)     # [G, S, k]
    if k > 1:
        gates = gates / tf.reduce_sum(gates, axis=-1, keepdims=True)
    # Position of each choice in its expert's buffer: every first choice of the group
    # before any second choice, each in token order (GShard's Algorithm 1).
    groups, tokens = masks.shape[0], masks.shape[1]
    by_rank = tf.reshape(tf.transpose(masks, [0, 2, 1, 3]), [groups, k * tokens, num_experts])
    before = tf.math.cumsum(by_rank, axis=1, exclusive=True)
    before = tf.transpose(tf.reshape(before, [groups, k, tokens, num_experts]), [0, 2, 1, 3])
    position = tf.reduce_sum(before * masks, axis=-1)                    # [G, S, k]
    # a position past the capacity has an all-zero one-hot row: that choice is dropped
    slots = tf.one_hot(tf.cast(position, tf.int32), expert_capacity,
                       dtype=masks.dtype)                                # [G, S, k, C]
    routed = tf.expand_dims(masks, -1) * tf.expand_dims(slots, 3)        # [G, S, k, E, C]
    dispatch_mask = tf.reduce_sum(routed, axis=2)                        # [G, S, E, C]
    combine_weights = tf.einsum("GSK,GSKEC->GSEC", gates, routed)
    # GShard's auxiliary loss: mean fraction of tokens whose first choice is e, times the
    # mean gate probability of e, summed over experts (scaled so uniform routing gives 1)
    first_choice = tf.reduce_mean(masks[:, :, 0, :], axis=1)            # [G, E]
    mean_probs = tf.reduce_mean(probs, axis=1)                           # [G, E]
    aux_loss = tf.reduce_mean(first_choice * mean_probs) * num_experts ** 2
    return dispatch_mask, combine_weights, aux_loss


def moe_layer(x, wg, w_in, w_out, k=2, capacity_factor=1.0, mesh=None, specs=None,
              annotate_gating=True):
    """GShard's MoE layer (module docstring): x [G, S, M], wg [M, E], w_in [E, M, H],
    w_out [E, H, M] -> (y [G, S, M], aux_loss). With `mesh` and `specs` (MoeSpecs) the
    tensors are annotated for gspmd-tf; otherwise it is plain single-device code.
    annotate_gating=False leaves the dispatch mask and combine weights unannotated (the
    GShard paper's Algorithm 2 annotates only x, the dispatched tensor and y)."""
    def split(t, role, hidden_dim=None):
        """`t` annotated with specs.<role>, its dim `hidden_dim` (if any) over the hidden
        axis (unchanged without a mesh)."""
        if mesh is None:
            return t
        spec = getattr(specs, role)
        return mesh_split(t, mesh, spec if hidden_dim is None
                          else specs.on_hidden(spec, hidden_dim))

    if (mesh is None) != (specs is None):
        raise ValueError("moe_layer: give both mesh and specs, or neither")
    x = split(x, "groups")
    w_in = split(w_in, "experts", hidden_dim=2)
    w_out = split(w_out, "experts", hidden_dim=1)
    with tf.name_scope("gating"):
        logits = tf.einsum("GSM,ME->GSE", x, wg)
        expert_capacity = capacity(x.shape[1], w_in.shape[0], k, capacity_factor)
        dispatch_mask, combine_weights, aux_loss = top_k_gating(logits, k, expert_capacity)
        # [G, S, E, C] split on G, as Lingvo's and Praxis' GShard layers annotate them:
        # with only the paper's four annotations, propagation gives the combine einsum's
        # GSEC operand the E split of its expert operand (the G split of the gating
        # reaches it through broadcasts, the last propagation layer), and XLA's GSPMD and
        # Shardy likewise end with all-gathers there (benchmarks/xla_moe.py)
        if annotate_gating:
            dispatch_mask = split(dispatch_mask, "groups")
            combine_weights = split(combine_weights, "groups")
    with tf.name_scope("dispatch"):
        dispatched = tf.einsum("GSEC,GSM->EGCM", dispatch_mask, x)
        dispatched = split(dispatched, "expert_buffers")
    with tf.name_scope("experts"):
        h = tf.nn.relu(tf.einsum("EGCM,EMH->EGCH", dispatched, w_in))
        if specs is not None and specs.hidden is not None:
            h = split(h, "expert_buffers", hidden_dim=3)
        expert_out = tf.einsum("EGCH,EHM->EGCM", h, w_out)
        expert_out = split(expert_out, "expert_buffers")
    with tf.name_scope("combine"):
        y = tf.einsum("GSEC,EGCM->GSM", combine_weights, expert_out)
    return split(y, "groups"), aux_loss
