"""Sharding propagation: op rules (rules.py, windowed.py) and the driver (propagate.py)."""

# rules first: it registers the windowed rules, which import it back
from gspmd_tf.propagation import rules  # noqa: F401
