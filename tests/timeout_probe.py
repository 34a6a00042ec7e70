"""A call whose collective never gets its peers fails fast, naming the user's function,
and the process runs collectives normally afterwards.

Run in its own process by tests/test_backend_local.py (a failure could otherwise leave
the test process's collectives aborted); prints "usable after the timeout" on success.
"""

import os
import time

os.environ["GSPMD_TF_COLLECTIVE_TIMEOUT"] = "3"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import gspmd_tf as gt  # noqa: E402
gt.configure_cpu_devices(8)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from gspmd_tf.backends import LocalBackend  # noqa: E402


class MisgroupedMesh(gt.Mesh):
    """Claims a third row [3, 4, 0, 7] of every 2-d group table: devices 1, 2, 5, 6 then
    wait in their collective for peers that have gone elsewhere."""

    def groups(self, axes):
        rows = super().groups(axes)
        return np.concatenate([rows, [[3, 4, 0, 7]]]) if rows.shape == (2, 4) else rows


mesh = gt.Mesh.create((2, 4), ("data", "model"))
bad_mesh = MisgroupedMesh(np.reshape(mesh.devices, (2, 4)), ("data", "model"))


def step(x):
    return tf.reduce_sum(x, axis=1)


def tf_collectives(m):
    """The local backend with TF's collective ops (copies cannot wait for a peer)."""
    return LocalBackend(m, copy_collectives=False)


good = gt.function(step, mesh=mesh, in_shardings=(gt.P("data", "model"),),
                   backend=tf_collectives)
bad = gt.function(step, mesh=mesh, in_shardings=(gt.P("data", "model"),),
                  backend=lambda m: tf_collectives(bad_mesh))
x = np.arange(32, dtype=np.float32).reshape(4, 8)
want = x.sum(1)
good.lower(x).compile()  # traced, not run: its groups are first formed by the hung call
start = time.monotonic()
try:
    bad(x)
    raise SystemExit("the misgrouped call returned")
except tf.errors.DeadlineExceededError as e:
    elapsed = time.monotonic() - start
    print(f"timed out after {elapsed:.1f} s: {e.message}")
    assert "gt.function 'step'" in e.message and "__inference" not in e.message, e.message
    assert elapsed < 20, elapsed
for _ in range(2):  # the program compiled before, a new one, and the hung one's mesh again
    np.testing.assert_allclose(good(x).numpy(), want)
    other = gt.function(lambda v: tf.reduce_max(v, axis=0), mesh=mesh,
                        in_shardings=(gt.P("data", "model"),), backend=tf_collectives)
    np.testing.assert_allclose(other(x).numpy(), x.max(0))
print("usable after the timeout")
