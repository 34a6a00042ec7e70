"""Errors raised by gspmd-tf."""


class ShardingError(ValueError):
    """A sharding annotation, mesh or argument that cannot be honoured.

    The message names the tensor, op or axis at fault and what to change.
    """

    # Autograph re-raises an error from traced code with its own type only when that
    # type's __init__ is Exception.__init__, and as a StagingError otherwise; this keeps
    # ShardingError catchable around a tf.function.
    __init__ = Exception.__init__
