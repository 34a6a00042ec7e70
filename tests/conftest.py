"""Test setup: 8 logical CPU devices, quiet TF logs, fast-failing collectives, hypothesis.

This runs before any test module, so the device split happens before TF's runtime starts.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Backends read this: a collective that cannot complete fails instead of hanging.
os.environ.setdefault("GSPMD_TF_COLLECTIVE_TIMEOUT", "60")
# The single-device reference is TF's own kernels. oneDNN's float32 softmax (on by default
# for x86) depends on the CPU's vector width for NaN/Inf rows: on AVX-512 a row with one
# NaN gives [nan, 0, ..., 0, nan] where TF's kernel, float64 and log_softmax give NaN.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from hypothesis import HealthCheck, settings  # noqa: E402

from gspmd_tf.devices import configure_cpu_devices  # noqa: E402

configure_cpu_devices(8)

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow],
    max_examples=int(os.environ.get("GSPMD_TF_EXAMPLES", "25")))
settings.register_profile(
    "fuzz", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
