"""The gspmd-tf backends the step benchmarks name in their --systems / --backends flags.

    auto        the default backend (the XLA or the local backend, chosen per program)
    xla         the XLA backend (compute between collectives compiled by XLA)
    local       the local backend (op by op; collectives of one process's CPU devices
                as cross-device reads)
    local_tf    the local backend with TF's collective ops (copy_collectives=False)
    local_each  the local backend running every op on every device
                (replicated_once=False: replicated values computed on each device)
    xla_tfdots  the XLA backend with the dots of at least `tf_dots_from` multiply-adds
                left to TF's kernels
    xla_plain   the XLA backend with TF's collective ops and every segment and op on
                every device (copy_collectives=False, replicated_once=False: the XLA
                backend before RESULTS §14.9)
"""

import functools

NAMES = ("auto", "xla", "local", "local_tf", "local_each", "xla_tfdots", "xla_plain")


def backend(name, tf_dots_from):
    """gt.function's `backend` argument for backend `name` (one of NAMES)."""
    if name == "local_tf":
        from gspmd_tf.backends.local import LocalBackend
        return functools.partial(LocalBackend, copy_collectives=False)
    if name == "local_each":
        from gspmd_tf.backends.local import LocalBackend
        return functools.partial(LocalBackend, replicated_once=False)
    if name == "xla_tfdots":
        from gspmd_tf.backends.xla import XlaBackend
        return functools.partial(XlaBackend, tf_dots_from=tf_dots_from)
    if name == "xla_plain":
        from gspmd_tf.backends.xla import XlaBackend
        return functools.partial(XlaBackend, copy_collectives=False, replicated_once=False)
    return name
