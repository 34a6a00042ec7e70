"""Logical CPU devices, so that one host can stand in for a mesh of devices."""

from __future__ import annotations

from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import check_count, local_device_names

# Measured (TF 2.21, 2 cores): 4096 logical devices start in 0.7 s, 32768 take 21 s and
# 650 MiB; larger meshes are better studied with gt.Mesh.abstract, which has no devices.
MAX_CPU_DEVICES = 4096


def configure_cpu_devices(n=8):
    """Split the first physical CPU into `n` logical TF devices (/device:CPU:0..n-1).

    TensorFlow fixes its devices when its runtime starts (the first op or device query),
    so call this before that. Calling it later is fine when the runtime already has at
    least `n` logical CPU devices; otherwise it raises ShardingError. `n` is an int from
    1 to MAX_CPU_DEVICES.
    """
    n = check_count(n, "configure_cpu_devices: the number of devices", high=MAX_CPU_DEVICES)
    import tensorflow as tf  # late, so that importing gspmd_tf does not start TF

    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured and len(configured) >= n:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:  # the runtime has started: devices can no longer change
        have = len(local_device_names("CPU"))  # this worker's, not the cluster's
        if have < n:
            raise ShardingError(
                f"configure_cpu_devices({n}): TensorFlow already started with {have} CPU "
                f"device(s); call gt.configure_cpu_devices({n}) before TensorFlow runs "
                "any op or lists its devices") from None
