"""The user's source line of a traced op: the innermost frame of the op's creation
traceback that is the user's own code (not TensorFlow's, Keras's, gspmd-tf's, an
installed package's or Python's)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig

# path parts of frames that are not the user's code: installed packages
_INSTALLED_PARTS = tuple(os.sep + part + os.sep for part in ("site-packages",
                                                             "dist-packages"))
_GRADIENT = "gradient_tape/"  # how TF names the gradient ops of a forward op
_STDLIB = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")})


def _package_dirs(names):
    """The directories (with a trailing separator) of the packages `names` that are
    installed, found without importing them: the libraries' own frames wherever they
    live (a source checkout too), and only theirs: a user's folder that happens to be
    named "keras" is the user's code."""
    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(os.path.join(os.path.realpath(location), ""))
    return tuple(dirs)


_LIBRARY_DIRS = _package_dirs(("tensorflow", "keras", "tf_keras", "keras_hub", "absl",
                               "gspmd_tf"))


@functools.lru_cache(maxsize=4096)  # a trace's frames come from a few files
def is_user_frame(filename: str) -> bool:
    """Whether a traceback frame in `filename` is the user's code."""
    if filename.startswith("<") or filename.startswith(_STDLIB) \
            or any(part in filename for part in _INSTALLED_PARTS):
        return False
    return not os.path.realpath(filename).startswith(_LIBRARY_DIRS)


class SourceLines:
    """"file.py:LINE" of the user's frame that created each op of traced tf.Graph
    `graph` (None: no graph, every answer is ""), looked up by IR node name and
    memoised. An op inlined from a nested function call or a control-flow body is not
    in `graph` itself: the enclosing op (the call) named by the longest prefix of its
    name stands for it. A gradient op ("gradient_tape/<forward op>/...") gets the line
    of the forward op it differentiates, when there is one."""

    def __init__(self, graph):
        self._graph = graph
        self._memo = {}

    def __call__(self, name: str) -> str:
        if self._graph is None or not name:
            return ""
        if name not in self._memo:
            forward = (self._lookup(name[len(_GRADIENT):])
                       if name.startswith(_GRADIENT) else None)
            self._memo[name] = forward or self._lookup(name)
        return self._memo[name]

    def _lookup(self, name):
        """The user line of op `name`, or of the op named by the longest prefix of
        `name`; None when no op is found."""
        parts = name.split("/")
        for end in range(len(parts), 0, -1):
            try:
                op = self._graph.get_operation_by_name("/".join(parts[:end]))
            except (KeyError, ValueError):
                continue
            for frame in reversed(op.traceback):
                if is_user_frame(frame.filename):
                    return f"{os.path.basename(frame.filename)}:{frame.lineno}"
            return ""
        return None
