"""Builds every csrc/<stem>.pyx into the extension module gspmd_tf._<stem>.

Metadata lives in pyproject.toml. For development: `python setup.py build_ext --inplace`
(what `make build` runs) puts the extensions next to the package sources.
"""

import glob
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup


def extensions():
    """One Extension per .pyx file in csrc/ (none is fine)."""
    found = []
    for path in sorted(glob.glob(os.path.join("csrc", "*.pyx"))):
        stem = os.path.splitext(os.path.basename(path))[0].lstrip("_")
        found.append(Extension(
            f"gspmd_tf._{stem}", [path], include_dirs=[np.get_include(), "csrc"],
            extra_compile_args=["-O3"],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]))
    return found


setup(ext_modules=cythonize(extensions(), language_level=3))
