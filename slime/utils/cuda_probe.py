"""How many CUDA devices this process sees, and the first one's memory, without importing torch.

The geo3k launcher asks this before choosing its GPU or CPU branch.  Importing torch for the same two numbers
costs seconds of CPU (about 2-3 s on a 2-core machine) at every start, on a CPU machine too; the CUDA driver API
answers in milliseconds and, like ``torch.cuda.device_count()``, counts only the devices ``CUDA_VISIBLE_DEVICES``
leaves visible (the driver applies it at ``cuInit``).

    python -c 'from slime.utils.cuda_probe import main; main()'   # prints "COUNT GIB", "0 0" without a GPU

(``-c`` rather than ``-m``: a run as ``__main__`` would not see a test's replacement of :func:`visible_devices`,
``tests/fixtures/fake_gpus/sitecustomize.py``.)
"""

from __future__ import annotations

import ctypes

CUDA_SUCCESS = 0


def _load_driver() -> ctypes.CDLL | None:
    """The CUDA driver library (``libcuda.so.1``, installed with the NVIDIA driver), or None where there is none."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def visible_devices(driver: ctypes.CDLL | None = None) -> tuple[int, int]:
    """``(count, gib)``: the CUDA devices this process may use and device 0's total memory in GiB (rounded down).

    Calls the driver API's ``cuInit``, ``cuDeviceGetCount``, ``cuDeviceGet`` and ``cuDeviceTotalMem_v2`` (CUDA
    Driver API reference, "Initialization" and "Device Management").  ``(0, 0)`` when there is no driver, no
    device, or any of these calls fails (``cuInit`` returns ``CUDA_ERROR_NO_DEVICE`` on a machine with the driver
    and no GPU, or with ``CUDA_VISIBLE_DEVICES`` empty).

    Args:
        driver: the loaded driver library; None loads ``libcuda.so.1`` (tests pass a stand-in).

    Raises:
        Nothing: a failure is ``(0, 0)``, which the launcher reads as "no GPU here".
    """
    driver = _load_driver() if driver is None else driver
    if driver is None or driver.cuInit(0) != CUDA_SUCCESS:
        return 0, 0
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.pointer(count)) != CUDA_SUCCESS or count.value <= 0:
        return 0, 0
    device = ctypes.c_int(0)
    total = ctypes.c_size_t(0)
    if (driver.cuDeviceGet(ctypes.pointer(device), 0) != CUDA_SUCCESS
            or driver.cuDeviceTotalMem_v2(ctypes.pointer(total), device) != CUDA_SUCCESS):
        return 0, 0
    return count.value, total.value >> 30


def main() -> None:
    """Print ``COUNT GIB`` (see :func:`visible_devices`)."""
    print(*visible_devices())
