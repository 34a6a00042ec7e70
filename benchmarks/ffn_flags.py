"""What lowering_time.py (--model=ffn_train) and xla_lowering_time.py share about the
feed-forward training step they both build: its size flags, learning rate and weight
shardings. Imports absl only, so the JAX script (no TF) and the TF script (no JAX) both
import it.
"""

from absl import flags

LR = 0.01
# the mesh axes of each layer's weights: W1, b1, W2, b2 (PartitionSpec entries)
WEIGHT_SPECS = ((None, "model"), ("model",), ("model",), ())


def define_sizes(*, batch, d_model, d_ff, seq=128, repeats=5):
    """Defines --batch, --seq, --d_model, --d_ff and --repeats with these defaults (each
    script keeps its own); returns their FlagHolders in that order."""
    return (flags.DEFINE_integer("batch", batch, "batch size"),
            flags.DEFINE_integer("seq", seq, "sequence length"),
            flags.DEFINE_integer("d_model", d_model, "model width"),
            flags.DEFINE_integer("d_ff", d_ff, "hidden (MLP) width"),
            flags.DEFINE_integer("repeats", repeats, "timed repeats (median reported)"))
