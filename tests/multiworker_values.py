"""The global values the multi-worker checkpoint tests save and restore (shared by the
worker probe and the test process)."""

import numpy as np


def checkpoint_values():
    """{name: global value} of the saved variables."""
    values = np.random.default_rng(1)
    return {"split": values.standard_normal((8, 12)).astype(np.float32),
            "rows": values.standard_normal((10, 3)).astype(np.float32),
            "replicated": values.standard_normal((5,)).astype(np.float32)}
