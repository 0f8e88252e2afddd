"""The launcher's GPU probe (:mod:`slime.utils.cuda_probe`): the CUDA driver API's answer, without torch."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from slime.utils import cuda_probe

REPO = Path(__file__).resolve().parents[1]


class StandInDriver:
    """``libcuda``'s four calls as the probe makes them: results written through the pointers it passes."""

    def __init__(self, count: int, total_bytes: int, fail: str | None = None, init_result: int = 0):
        self.count, self.total_bytes, self.fail, self.init_result = count, total_bytes, fail, init_result
        self.calls: list[str] = []

    def _result(self, name: str) -> int:
        self.calls.append(name)
        return 1 if self.fail == name else 0

    def cuInit(self, flags):  # noqa: N802 (the driver's names)
        self.calls.append("cuInit")
        assert flags == 0
        return self.init_result

    def cuDeviceGetCount(self, count):  # noqa: N802
        count.contents.value = self.count
        return self._result("cuDeviceGetCount")

    def cuDeviceGet(self, device, ordinal):  # noqa: N802
        assert ordinal == 0
        device.contents.value = 7  # an opaque handle, handed back to cuDeviceTotalMem_v2
        return self._result("cuDeviceGet")

    def cuDeviceTotalMem_v2(self, total, device):  # noqa: N802
        assert device.value == 7
        total.contents.value = self.total_bytes
        return self._result("cuDeviceTotalMem_v2")


@pytest.fixture
def cuda_build(tmp_path) -> Path:
    """A ``torch/version.py`` as a CUDA build of torch writes it."""
    path = tmp_path / "version.py"
    path.write_text("from typing import Optional\n__version__ = '2.11.0+cu130'\ndebug = False\n"
                    "cuda: Optional[str] = '13.0'\ngit_version = 'abc'\nhip: Optional[str] = None\n")
    return path


def test_count_and_gib_of_device_0_rounded_down(cuda_build):
    h100 = 81559 * 2**20  # an H100 80GB HBM3's 81,559 MiB: 79.6 GiB
    assert cuda_probe.visible_devices(StandInDriver(8, h100), cuda_build) == (8, 79)
    assert cuda_probe.visible_devices(StandInDriver(1, 150 * 2**30 - 1), cuda_build) == (1, 149)


def test_a_cpu_build_of_torch_sees_no_gpu_whatever_the_driver_sees(tmp_path, cuda_build):
    cpu_build = tmp_path / "cpu_version.py"
    cpu_build.write_text("from typing import Optional\n__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n")
    driver = StandInDriver(8, 2**40)
    assert cuda_probe.torch_cuda_version(cpu_build) is None
    assert cuda_probe.visible_devices(driver, cpu_build) == (0, 0)
    assert driver.calls == []  # the driver is not even asked
    assert cuda_probe.torch_cuda_version(cuda_build) == "13.0"
    assert cuda_probe.visible_devices(StandInDriver(8, 2**40), tmp_path / "missing.py") == (0, 0)


def test_the_installed_torchs_build_is_read_without_importing_it():
    code = ("import sys; from slime.utils.cuda_probe import torch_cuda_version; v = torch_cuda_version(); "
            "import torch; print(v == torch.version.cuda, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


def test_a_driver_without_an_entry_point_reads_as_no_gpu(cuda_build):
    class OldDriver(StandInDriver):
        def __getattribute__(self, name):
            if name == "cuDeviceTotalMem_v2":
                raise AttributeError(name)
            return super().__getattribute__(name)

    assert cuda_probe.visible_devices(OldDriver(2, 2**40), cuda_build) == (0, 0)


@pytest.mark.parametrize("driver", [
    StandInDriver(2, 2**40, init_result=100),  # CUDA_ERROR_NO_DEVICE: a driver and no GPU, or CUDA_VISIBLE_DEVICES=""
    StandInDriver(0, 2**40),
    StandInDriver(2, 2**40, fail="cuDeviceGetCount"),
    StandInDriver(2, 2**40, fail="cuDeviceGet"),
    StandInDriver(2, 2**40, fail="cuDeviceTotalMem_v2"),
], ids=["no-device", "zero", "count-fails", "get-fails", "memory-fails"])
def test_any_failure_reads_as_no_gpu(driver, cuda_build):
    assert cuda_probe.visible_devices(driver, cuda_build) == (0, 0)


def test_no_driver_library_reads_as_no_gpu(monkeypatch, cuda_build):
    def missing(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert cuda_probe.visible_devices(None, cuda_build) == (0, 0)


def test_the_launchers_command_prints_count_and_gib_without_importing_torch():
    code = "import sys; from slime.utils.cuda_probe import main; main(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    count, gib, torch_imported = out.split()
    assert torch_imported == "False"
    launcher = (REPO / "examples" / "geo3k_vlm" / "run_geo3k_qwen35.sh").read_text()
    assert "'from slime.utils.cuda_probe import main; main()'" in launcher
    if cuda_probe.torch_cuda_version() is None:  # a CPU build of torch, as on CPU machines and CI
        assert (count, gib) == ("0", "0")


@pytest.mark.gpu
def test_the_probe_agrees_with_torch_on_a_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    n = torch.cuda.device_count()
    assert cuda_probe.visible_devices() == (n, torch.cuda.get_device_properties(0).total_memory >> 30)
