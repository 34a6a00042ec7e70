"""Backends: lower an SPMD program onto concrete devices (see base.Backend)."""

from gspmd_tf.backends.auto import AutoBackend
from gspmd_tf.backends.base import Backend
from gspmd_tf.backends.local import LocalBackend
from gspmd_tf.backends.xla import XlaBackend

__all__ = ["AutoBackend", "Backend", "LocalBackend", "XlaBackend"]
