"""Sharding propagation: the rule record (oprule.py), the rule builders by op family
(rules/, windowed.py) and the driver (propagate.py). Which builder serves which op type
is the op registry's (gspmd_tf/registry.py)."""
