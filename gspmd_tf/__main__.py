"""`python -m gspmd_tf inspect SAVED_MODEL ...` (see gspmd_tf.cli)."""

from absl import flags

from gspmd_tf import cli
from gspmd_tf.cli import main

# absl's --help prints the __main__ module's doc and key flags: make them the CLI's
__doc__ = cli.__doc__
flags.adopt_module_key_flags(cli)

if __name__ == "__main__":
    main()
