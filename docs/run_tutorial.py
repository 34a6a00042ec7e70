"""Run the code of docs/TUTORIAL.md and write what it prints under each block.

    .venv/bin/python docs/run_tutorial.py      # rewrites docs/TUTORIAL.md in place

Every ```python block runs in one shared namespace, in order; every ```sh block runs in
bash; both in a scratch directory. The ```text block right after a code block is
replaced by what that block printed (one is added when missing; none for blocks that
print nothing), so the output shown in the tutorial is the output of its code.
"""

import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "TUTORIAL.md")
ROOT = os.path.dirname(os.path.dirname(DOC))
BLOCK = re.compile(r"```(python|sh)\n(.*?)```\n(?:\n```text\n.*?```\n)?", re.S)


def main():
    text = open(DOC, encoding="utf-8").read()
    scratch = tempfile.mkdtemp(prefix="gt_tutorial_")
    os.chdir(scratch)
    sys.path.insert(0, ROOT)
    namespace = {"__name__": "__tutorial__"}
    # `python` in the shell blocks is this interpreter
    os.makedirs("bin")
    with open(os.path.join("bin", "python"), "w") as f:  # a symlink would lose the venv
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    os.chmod(os.path.join("bin", "python"), 0o755)
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               PATH=os.path.join(scratch, "bin") + os.pathsep + os.environ["PATH"])

    def run(match):
        kind, code = match.group(1), match.group(2)
        if kind == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, "TUTORIAL.md", "exec"), namespace)  # noqa: S102
            printed = out.getvalue()
        else:
            done = subprocess.run(["bash", "-c", code], capture_output=True, text=True,
                                  env=env)
            if done.returncode:
                raise RuntimeError(f"{code} failed:\n{done.stderr}")
            printed = done.stdout
        block = f"```{kind}\n{code}```\n"
        return block + (f"\n```text\n{printed.rstrip()}\n```\n" if printed.strip() else "")

    text = BLOCK.sub(run, text)
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
