"""`python -m gspmd_tf inspect SAVED_MODEL ...` (see gspmd_tf.cli)."""

from gspmd_tf.cli import main

if __name__ == "__main__":
    main()
