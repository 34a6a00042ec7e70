"""Test setup: 8 logical CPU devices, quiet TF logs, fast-failing collectives, hypothesis.

This runs before any test module, so the device split happens before TF's runtime starts.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TF turns its oneDNN CPU kernels on by default only on some x86 CPUs; on the others
# (AMD EPYC here) the Eigen kernels refuse programs the suite compares against (a dilated
# Conv3D, an NCDHW layout). The suite checks partitioning against single-device TF, so it
# asks for the same kernels on every machine (the workers the fuzz tests start inherit it).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
# Backends read this: a collective that cannot complete fails instead of hanging.
os.environ.setdefault("GSPMD_TF_COLLECTIVE_TIMEOUT", "60")
# The suite runs on the default backend (by platform: on these CPU devices the local
# one). The XLA backend has its own tests on every mesh shape (test_xla_*.py), "auto"
# its choice (test_auto_backend.py); GSPMD_TF_BACKEND=auto or xla runs the suite on
# those.

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from gspmd_tf.devices import configure_cpu_devices  # noqa: E402

configure_cpu_devices(8)

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow],
    max_examples=int(os.environ.get("GSPMD_TF_EXAMPLES", "25")))
settings.register_profile(
    "fuzz", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def mesh():
    """The 2x4 ("data", "model") mesh most tests run on (a module may define its own)."""
    import gspmd_tf as gt
    return gt.Mesh.create((2, 4), ("data", "model"))


@pytest.fixture
def rng():
    """A fresh seeded generator per test."""
    import numpy as np
    return np.random.default_rng(0)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "long: a slow case kept out of `make test` (15-minute budget); "
                   "`make test-long` runs it")


def pytest_collection_modifyitems(config, items):
    """Skip @pytest.mark.long cases unless GSPMD_TF_LONG=1 (set by `make test-long`)."""
    if os.environ.get("GSPMD_TF_LONG") == "1":
        return
    skip = pytest.mark.skip(reason="long case: `make test-long` runs it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the background jobs (util.Background) of the modules whose tests run;
    GSPMD_TF_TEST_BACKGROUND=0 leaves each to run when a test first reads it (the
    suite's timing without the overlap, for comparison)."""
    if (session.config.option.collectonly or not session.items
            or os.environ.get("GSPMD_TF_TEST_BACKGROUND", "1") == "0"):
        return
    import util
    modules = (getattr(item, "module", None) for item in session.items)
    util.start_background({module.__name__ for module in modules if module is not None})


def pytest_sessionfinish(session):
    """End the background jobs' processes still running."""
    import util
    util.stop_background()
