"""tf.py_function / tf.numpy_function (EagerPyFunc, PyFunc): run once per call.

Every device runs its part of the program, so a Python function replayed as it is would
run once per device, its side effects (a counter, a log line, a file written) repeated
mesh.size times. Its inputs are gathered whole (nothing of the function is known, so
nothing is split) and the op replayed with a token of its own: a _OncePerCall registered
in TF's py_func registry, which calls the user's function for the first device that
arrives with an input value and hands that result to the other devices that run the op
with the same value. Every device gets the same (replicated) result, as on one device.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
from tensorflow.python.ops import script_ops

from gspmd_tf.propagation.rules import batched
from gspmd_tf.registry import op_family
from gspmd_tf.spmd.handlers.basic import replay


class _OncePerCall:
    """The user's function `func`, called once for the `copies` devices that run the op
    with equal inputs: the first of them to arrive calls it, the others get its result.
    (Keyed by the input values: a device a loop iteration ahead, with other inputs, waits
    for nothing and gets its own call.)"""

    def __init__(self, func, copies):
        self.func, self.copies = func, copies
        self._lock = threading.Lock()
        self._pending = {}  # input key -> [result, devices still to hand it to]

    def __call__(self, *args):
        values = [np.asarray(a) for a in args]
        key = tuple((v.dtype.str, v.shape, v.tobytes()) for v in values)
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = [self.func(*args), self.copies]
            pending[1] -= 1
            if pending[1] == 0:
                del self._pending[key]
            return pending[0]


def _once_per_call_entry(entry, copies):
    """A registry entry like TF's `entry` whose function runs once per call: for
    EagerPyFunc an EagerFunc (it copies the result to each device's op), for PyFunc
    (tf.numpy_function) the function itself."""
    if not isinstance(entry, script_ops.EagerFunc):
        return _OncePerCall(entry, copies)
    # pylint: disable=protected-access
    once = script_ops.EagerFunc(_OncePerCall(entry._func, copies), entry._out_dtypes,
                                entry._is_grad_func)
    once._support_graph_mode_gradient = entry._support_graph_mode_gradient
    return once


# TF's registry holds its entries weakly, and the traced function keeps TF's entry
# alive: ours live as long as TF's, as {TF's entry: {device count: (ours, its token)}};
# a function that cannot be weakly referenced (a builtin) keeps them for good
_OURS = weakref.WeakKeyDictionary()
_OURS_FOR_GOOD = {}


@op_family(["EagerPyFunc", "PyFunc"], batched.all_whole)
def once_per_call(ctx, operands, layouts):
    """Replay with the token of a once-per-call entry (alive as long as the program)."""
    token = ctx.node.attr("token")
    token = token.decode() if isinstance(token, bytes) else token
    entry = script_ops._py_funcs.get(token)  # pylint: disable=protected-access
    if entry is None:  # the traced function is gone: replay as it is (TF then reports)
        return replay(ctx, operands, layouts)
    return replay(ctx, operands, layouts,
                  attrs={"token": _token_of_ours(entry, len(ctx.mesh.addressable_ids))})


def _token_of_ours(entry, copies):
    """The registry token of the once-per-call entry of TF's `entry` for `copies`
    devices (made once per entry and device count)."""
    try:
        ours = _OURS.setdefault(entry, {})
    except TypeError:  # not weakly referenceable
        ours = _OURS_FOR_GOOD.setdefault(id(entry), {"entry": entry})
    if copies not in ours:
        wrapped = _once_per_call_entry(entry, copies)
        registry = script_ops._py_funcs  # pylint: disable=protected-access
        ours[copies] = (wrapped, registry.insert(wrapped))
    return ours[copies][1]
