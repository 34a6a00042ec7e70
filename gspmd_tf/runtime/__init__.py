"""The stages around the partitioner: trace (trace.py), lower (lowering.py: import,
propagate, partition into a Lowered, lowered.py), run (function.py: gt.function and
gt.lower; sharded_tensor.py and variables.py hold the per-device values)."""
