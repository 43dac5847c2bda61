"""The NVML wrapper: lazy init, typed errors, N/A, and the real pynvml on this machine."""

from __future__ import annotations

import ctypes.util
import importlib
import math
import subprocess
import sys
import threading

import pytest

from tests.helpers import fakenvml
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from trainguard.agent.collectors.base import CollectorUnavailable, noop_emit
from trainguard.agent.collectors.gpu import GpuCollector, GpuLost, Nvml, NvmlUnavailable
from trainguard.agent.collectors.gpu import nvml as wrapper


def _real_libnvml_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return ctypes.util.find_library("nvidia-ml") is not None


def test_init_is_lazy_and_once_under_concurrency() -> None:
    fake = FakeNvml()
    nv = Nvml(module=fake)
    assert fake.init_calls == 0  # constructing the wrapper touches nothing
    threads = [threading.Thread(target=nv.device_count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.init_calls == 1
    nv.shutdown()
    nv.shutdown()
    assert fake.shutdown_calls == 1


def test_query_turns_unsupported_into_na_and_default() -> None:
    gpu = FakeGpu(unsupported={"nvmlDeviceGetPowerUsage"})
    nv = Nvml(module=FakeNvml([gpu]))
    h = nv.handle(0)
    assert math.isnan(nv.query("nvmlDeviceGetPowerUsage", h))
    assert nv.query("nvmlDeviceGetPowerUsage", h, default=None) is None
    assert nv.query("nvmlDeviceGetTemperature", h, 0) == 45
    # a binding this module does not have is N/A too (older nvidia-ml-py)
    assert math.isnan(nv.query("nvmlDeviceGetSomethingFromTheFuture", h))


def test_lost_gpu_raises_typed_error_not_na() -> None:
    gpu = FakeGpu()
    nv = Nvml(module=FakeNvml([gpu]))
    h = nv.handle(0)
    gpu.lose()
    with pytest.raises(GpuLost, match="GPU is lost"):
        nv.query("nvmlDeviceGetTemperature", h, 0)


@pytest.mark.parametrize(
    ("code", "hint"),
    [
        (fakenvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1"),
        (fakenvml.NVML_ERROR_DRIVER_NOT_LOADED, "kernel module"),
        (fakenvml.NVML_ERROR_NO_PERMISSION, "/dev/nvidia"),
    ],
)
def test_unavailable_message_is_one_error_hint_line(code: int, hint: str) -> None:
    nv = Nvml(module=FakeNvml(init_error=code))
    with pytest.raises(NvmlUnavailable) as info:
        nv.init()
    msg = str(info.value)
    assert msg.startswith("ERROR NVML unavailable: ") and " HINT " in msg and hint in msg
    assert "\n" not in msg
    assert not nv.initialized


def test_missing_python_package_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(NvmlUnavailable, match="pip install nvidia-ml-py"):
        Nvml().init()


def test_real_pynvml_here() -> None:
    """The real library on this machine: no GPU -> CollectorUnavailable with one clear line;
    on a GPU machine the same test checks the collector starts and reads every GPU."""
    col = GpuCollector(noop_emit)
    if _real_libnvml_present():
        col.start()
        try:
            col.poll(0.0)
            assert col.readings()
        finally:
            col.stop()
        return
    with pytest.raises(CollectorUnavailable) as info:
        col.start()
    msg = str(info.value)
    assert "NVML Shared Library Not Found" in msg and "HINT" in msg and "\n" not in msg
    assert col.down_reason == msg


def test_no_gpu_is_unavailable() -> None:
    col = GpuCollector(noop_emit, Nvml(module=FakeNvml(gpus=[])))
    with pytest.raises(CollectorUnavailable, match="no GPU found"):
        col.start()


def test_fake_matches_real_pynvml_api() -> None:
    """The fake must not drift from pynvml: same function names, constants and error codes."""
    real = importlib.import_module("pynvml")
    for name in fakenvml.FUNCTIONS:
        assert callable(getattr(real, name, None)), name
    for name, value in vars(fakenvml).items():
        if name.startswith(("NVML_", "nvmlEventType", "nvmlClocksEventReason", "nvmlMemory_")):
            assert getattr(real, name) == value, name
        if name.startswith("NVMLError_"):
            real_cls = getattr(real, name, None)
            assert real_cls is not None, name
            assert real.NVMLError.__new__(real.NVMLError, value(0).value).__class__.__name__ == name
    assert not issubclass(real.NVMLLibraryMismatchError, real.NVMLError)  # why the wrapper catches it apart
    # the wrapper's own copies of the NVML enums
    for name, value in vars(wrapper).items():
        if name.startswith(
            ("NVML_ERROR_", "NVML_FI_", "NVML_CLOCK_SM", "NVML_TEMPERATURE_GPU", "NVML_PCIE_UTIL")
        ):
            assert getattr(real, name) == value, name
    assert wrapper.NVML_MEMORY_V2 == real.nvmlMemory_v2
    assert wrapper.EVENT_XID_CRITICAL == real.nvmlEventTypeXidCriticalError
    assert wrapper.EVENT_DOUBLE_BIT_ECC == real.nvmlEventTypeDoubleBitEccError


def test_only_the_wrapper_imports_pynvml() -> None:
    """`import agent.collectors.gpu` must not load pynvml (the agent starts without it)."""
    code = "import sys, agent.collectors.gpu as g; g.Nvml(); print('pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
