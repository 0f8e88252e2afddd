"""How many CUDA devices this process's torch can use, and the first one's memory, without importing torch.

The geo3k launcher asks this before choosing its GPU or CPU branch.  Importing torch for the same two numbers
costs seconds of CPU (about 2-3 s on a 2-core machine) at every start, on a CPU machine too; the CUDA driver API
answers in milliseconds and, like ``torch.cuda.device_count()``, counts only the devices ``CUDA_VISIBLE_DEVICES``
leaves visible (the driver applies it at ``cuInit``).  As with ``torch.cuda.device_count()``, a CPU build of torch
sees no device, whatever the driver sees (``torch/version.py``'s ``cuda`` is read, not imported).  NVIDIA only: a
ROCm machine has no ``libcuda`` and reads as no GPU (the recipe's GPU profile is CUDA).

    python -c 'from slime.utils.cuda_probe import main; main()'   # prints "COUNT GIB", "0 0" without a GPU

(``-c`` rather than ``-m``: a run as ``__main__`` would not see a test's replacement of :func:`visible_devices`,
``tests/fixtures/fake_gpus/sitecustomize.py``.)
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
from pathlib import Path

CUDA_SUCCESS = 0


def _load_driver() -> ctypes.CDLL | None:
    """The CUDA driver library (``libcuda.so.1``, installed with the NVIDIA driver), or None where there is none."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def torch_cuda_version(version_file: Path | None = None) -> str | None:
    """The CUDA version torch was built for (``torch.version.cuda``, e.g. ``"13.0"``), or None for a CPU build or no
    torch; read from ``torch/version.py`` without importing torch.

    Args:
        version_file: a ``version.py`` to read; None finds the installed torch's (tests pass their own).
    """
    if version_file is None:
        spec = importlib.util.find_spec("torch")  # a top-level package: found, not imported
        if spec is None or spec.origin is None:
            return None
        version_file = Path(spec.origin).with_name("version.py")
    try:
        text = version_file.read_text()
    except OSError:
        return None
    match = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else None


def visible_devices(driver: ctypes.CDLL | None = None, version_file: Path | None = None) -> tuple[int, int]:
    """``(count, gib)``: the CUDA devices this process's torch may use and device 0's total memory in GiB (rounded
    down); ``(0, 0)`` for a CPU build of torch (:func:`torch_cuda_version`).

    Calls the driver API's ``cuInit``, ``cuDeviceGetCount``, ``cuDeviceGet`` and ``cuDeviceTotalMem_v2`` (CUDA
    Driver API reference, "Initialization" and "Device Management").  ``(0, 0)`` when there is no driver, no
    device, or any of these calls fails (``cuInit`` returns ``CUDA_ERROR_NO_DEVICE`` on a machine with the driver
    and no GPU, or with ``CUDA_VISIBLE_DEVICES`` empty).

    Args:
        driver: the loaded driver library; None loads ``libcuda.so.1`` (tests pass a stand-in).
        version_file: passed to :func:`torch_cuda_version`.

    Raises:
        Nothing: a failure (a driver too old for ``cuDeviceTotalMem_v2`` included) is ``(0, 0)``, which the
        launcher reads as "no GPU here".
    """
    if torch_cuda_version(version_file) is None:
        return 0, 0
    driver = _load_driver() if driver is None else driver
    try:
        return _ask(driver)
    except AttributeError:  # a driver library without one of the four entry points
        return 0, 0


def _ask(driver) -> tuple[int, int]:
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
