"""gt.AUTO: an in_shardings / out_shardings entry whose layout the search chooses."""

from __future__ import annotations


class _Auto:
    """The AUTO entry (JAX's spelling, jax.sharding.AUTO): the auto-sharding search
    chooses this argument's or output's layout. `gt.AUTO` and `gt.AUTO(mesh)` (JAX's
    call form) are the same entry."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __call__(self, mesh=None):
        """JAX spells the entry `AUTO(mesh)`; the mesh is gt.function's, so it is the
        same entry."""
        return self

    def __repr__(self):
        return "AUTO"

    def __reduce__(self):
        return (_Auto, ())


AUTO = _Auto()


def is_auto(entry) -> bool:
    """Whether an in/out_shardings entry is gt.AUTO."""
    return entry is AUTO
