"""The collective timeout: how long a call of a program, or a wait for other workers,
may take before it is cancelled (a leaf module: the backends and cluster.py read it)."""

from __future__ import annotations

import os

# Generous: a call that waits this long is hung, not slow, on the meshes of one host.
DEFAULT_TIMEOUT = 300.0


def default_timeout():
    """GSPMD_TF_COLLECTIVE_TIMEOUT (seconds) when set, else DEFAULT_TIMEOUT."""
    text = os.environ.get("GSPMD_TF_COLLECTIVE_TIMEOUT")
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        return check_timeout(float(text))
    except ValueError:
        raise ValueError(f"GSPMD_TF_COLLECTIVE_TIMEOUT={text!r}: give a number of seconds "
                         "(0 for no limit)") from None


def check_timeout(seconds):
    """`seconds` as a float; ValueError unless it is a finite number >= 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"collective_timeout={seconds!r}: give a finite number of seconds "
                         ">= 0 (0 for no limit)")
    return float(seconds)
