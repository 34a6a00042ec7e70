"""LowerOptions: what is fixed for every lowering of one gt.function or gt.lower call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import Mesh, PartitionSpec


@dataclass(frozen=True)
class LowerOptions:
    """The options the lowering stages (import, propagate, partition) and compile read.

    mesh             the mesh the program is partitioned over
    backend_factory  mesh -> gspmd_tf.backends.Backend, which compiles the program (see
                     runtime.function.backend_factory); None where nothing compiles
                     (`python -m gspmd_tf inspect` lowers for an abstract mesh)
    name             the function's name, used in errors
    caller           the entry point, used in errors and logs ("gt.function", "gt.lower")
    out_shardings    one entry per flat output (a PartitionSpec, a gt.Sharding or None),
                     or None: propagation decides every output
    windowed_einsum  the byte threshold of windowed dots (spmd/windowed_einsum.py), or
                     None for none
    memory_limit     per-device bytes the auto-sharding search (gspmd_tf/autoshard) must
                     fit the plan of gt.AUTO entries in, or None for no limit
    """

    mesh: Mesh
    backend_factory: Optional[Callable]
    name: str
    caller: str = "gt.function"
    out_shardings: Optional[Sequence] = None
    windowed_einsum: Optional[int] = None
    memory_limit: Optional[int] = None

    @property
    def program_name(self) -> str:
        """How logs, errors and Lowered.name call the program: `gt.function 'f'`."""
        return f"{self.caller} {self.name!r}"


def check_entries(kind: str, entries, per: str) -> None:
    """in/out_shardings must be a sequence with one entry per argument / flat output."""
    if entries is not None and (isinstance(entries, PartitionSpec)
                                or not isinstance(entries, (tuple, list))):
        raise ShardingError(
            f"{kind}={entries!r}: give a tuple with one entry per {per}, e.g. "
            f"{kind}=(P('data'),) for one")


def check_memory_limit(memory_limit) -> Optional[int]:
    """memory_limit must be None or a positive number of bytes."""
    if memory_limit is None:
        return None
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)) \
            or not memory_limit > 0:
        raise ShardingError(f"memory_limit={memory_limit!r}: give the per-device bytes the "
                            "plan of the gt.AUTO entries must fit in (e.g. 2**30), or None")
    return int(memory_limit)
