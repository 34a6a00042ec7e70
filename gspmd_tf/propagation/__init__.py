"""Sharding propagation: rule builders (rules.py, windowed.py) and the driver
(propagate.py). Which builder serves which op type is the op registry's
(gspmd_tf/registry.py)."""
