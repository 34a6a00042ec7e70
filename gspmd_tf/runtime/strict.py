"""Strict mode (gt.function(..., strict=True)): data movement the partitioner adds on its
own is an error at lowering, as JAX's explicit sharding mode makes it one.

Allowed: every collective at a user's own sharding (gt.mesh_split, xla_sharding,
in/out_shardings: reason "annotation"), and the all-reduce or reduce-scatter that sums a
contraction or reduction over a split dim (reason "contraction", or an op's own
algorithm summing its partial results). Refused: any all-gather, all-to-all or
collective-permute the partitioner chose, and every op that runs replicated on operands
it had to gather (reason "no rule"). The error names each refused collective's op, the
user's source line, the tensor, both shardings and the annotation that would make the
movement explicit.
"""

from __future__ import annotations

from gspmd_tf.errors import ShardingError
from gspmd_tf.spmd.provenance import REASONS

_SUMS = ("all-reduce", "reduce-scatter")
_SHOWN = 5  # refused collectives an error spells out


def allowed(kind: str, reason: str) -> bool:
    """Whether strict mode lets a collective of `kind` made for `reason` through."""
    return reason == "annotation" or (kind in _SUMS and reason in ("contraction",
                                                                   "op algorithm"))


def check_strict(lowered) -> None:
    """ShardingError listing the collectives of `lowered` (a gt.Lowered) that strict mode
    refuses (see the module doc); nothing when there are none."""
    refused = [(c, origin) for c in lowered.collectives()
               for origin in (c.origins or (None,))
               if origin is None or not allowed(c.kind, origin.reason)]
    if not refused:
        return
    parts = [_describe(lowered, c, origin) for c, origin in refused[:_SHOWN]]
    more = len(refused) - _SHOWN
    raise ShardingError(
        f"{lowered.name} (strict=True): the partitioner would move data on its own "
        f"{len(refused)} time(s):\n  " + "\n  ".join(parts)
        + (f"\n  ... and {more} more" if more > 0 else "")
        + "\nAnnotate as suggested to ask for each movement explicitly, change the "
        "shardings so they agree, or pass strict=False.")


def _describe(lowered, collective, origin) -> str:
    """One refused collective: what moves where, why, and the annotation to write."""
    if origin is None:
        return f"{collective.kind} of {collective.shape} (origin unknown)"
    where = f" at {origin.source}" if origin.source else ""
    head = (f"{collective.kind}: op {origin.op!r}{where} ({origin.reason}: "
            f"{REASONS[origin.reason]})")
    if origin.from_spec is None:
        return (head + f"; its operands split over {collective.axes} make it exchange "
                "data: annotate them whole along those axes with gt.mesh_split, or "
                "partition this op's input another way")
    result = origin.tensor.split(":")[0] == origin.op  # the op's own result moves
    return (head + f"; it moves {origin.tensor!r} from {origin.from_spec!r} to "
            f"{origin.to_spec!r}: make that explicit with `gt.mesh_split("
            f"{_variable(origin.tensor)}, mesh, {origin.to_spec!r})` on {origin.tensor!r} "
            + (f"(the result of op {origin.op!r})" if result else f"before op {origin.op!r}"))


def _variable(tensor: str) -> str:
    """A Python-ish name for graph tensor `tensor` in a suggested annotation."""
    name = tensor.rsplit("/", 1)[-1].split(":")[0]
    return name[:1].lower() + name[1:] if name else "x"
