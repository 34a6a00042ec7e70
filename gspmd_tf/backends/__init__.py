"""Backends: lower an SPMD program onto concrete devices, behind one protocol
(base.Backend: capabilities, compile(program) -> base.Compiled). The default is chosen
by platform (auto.for_platform)."""

from gspmd_tf.backends.auto import AutoBackend, for_platform
from gspmd_tf.backends.base import Backend, Capabilities, Compiled
from gspmd_tf.backends.local import LocalBackend
from gspmd_tf.backends.xla import XlaBackend
from gspmd_tf.backends.xla_bridge import XlaBridgeBackend

__all__ = ["AutoBackend", "Backend", "Capabilities", "Compiled", "LocalBackend",
           "XlaBackend", "XlaBridgeBackend", "for_platform"]
