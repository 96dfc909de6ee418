"""The NVML funnel: error mapping, counting, the v2 → v1 fallback, and behaviour without a GPU."""

import ctypes

import pynvml
import pytest

from collector import nvml
from collector.nvml import (
    NvmlGpuLost,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlUnavailable,
    NvmlUnknown,
    map_error,
    open_reader,
)


@pytest.mark.parametrize(
    ("code", "cls", "kind"),
    [
        (pynvml.NVML_ERROR_NOT_SUPPORTED, NvmlNotSupported, "not_supported"),
        (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, NvmlNotSupported, "not_supported"),
        (pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH, NvmlNotSupported, "not_supported"),
        (pynvml.NVML_ERROR_GPU_IS_LOST, NvmlGpuLost, "gpu_lost"),
        (pynvml.NVML_ERROR_RESET_REQUIRED, NvmlGpuLost, "gpu_lost"),
        (pynvml.NVML_ERROR_NOT_FOUND, NvmlNotFound, "not_found"),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, NvmlUnavailable, "unavailable"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, NvmlUnavailable, "unavailable"),
        (pynvml.NVML_ERROR_UNKNOWN, NvmlUnknown, "unknown"),
        (pynvml.NVML_ERROR_TIMEOUT, NvmlUnknown, "unknown"),
        (999, NvmlUnknown, "unknown"),
    ],
)
def test_error_codes_map_to_typed_errors(code, cls, kind):
    err = map_error(code, "nvmlSomething")
    assert type(err) is cls
    assert err.kind == kind and err.code == code
    assert str(err).startswith("nvmlSomething: ")


class _FakeC:
    """A stand-in for a libnvidia-ml function: fills the struct it is given, or returns a code."""

    def __init__(self, ret: int = 0, used: int = 0, reserved: int = 0, total: int = 0):
        self.ret, self.used, self.reserved, self.total = ret, used, reserved, total
        self.calls = 0

    def __call__(self, handle, ref):
        self.calls += 1
        if self.ret:
            return self.ret
        s = ref._obj
        s.used, s.total = self.used, self.total
        if hasattr(s, "reserved"):
            s.reserved = self.reserved
        return 0


def test_v2_reader_reports_reserved_apart():
    fns = {"nvmlDeviceGetMemoryInfo_v2": _FakeC(used=5 << 30, reserved=615 << 20, total=140 << 30)}
    reader = open_reader(ctypes.c_void_p(), fns.__getitem__)
    assert reader.version == 2
    assert reader.read() == (5 << 30, 615 << 20)
    mem = reader.memory()
    assert mem.version == 2 and mem.total == 140 << 30


def test_falls_back_to_v1_when_v2_is_not_supported():
    v2 = _FakeC(ret=pynvml.NVML_ERROR_NOT_SUPPORTED)
    v1 = _FakeC(used=6 << 30, total=80 << 30)
    fns = {"nvmlDeviceGetMemoryInfo_v2": v2, "nvmlDeviceGetMemoryInfo": v1}
    reader = open_reader(ctypes.c_void_p(), fns.__getitem__)
    assert reader.version == 1
    assert reader.read() == (6 << 30, 0)  # v1: used includes driver-reserved; reserved is 0
    assert v2.calls == 1 and v1.calls == 1


def test_falls_back_to_v1_when_the_driver_lacks_the_v2_symbol():
    def resolve(name):
        if name.endswith("_v2"):
            raise map_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, name)
        return _FakeC(used=1, total=2)

    assert open_reader(ctypes.c_void_p(), resolve).version == 1


def test_reader_errors_are_typed_and_counted():
    before = nvml.ERROR_COUNTS["gpu_lost"]
    lost = _FakeC(ret=pynvml.NVML_ERROR_GPU_IS_LOST)
    reader = nvml._MemoryReader(ctypes.c_void_p(), 2, {"nvmlDeviceGetMemoryInfo_v2": lost}.get)
    with pytest.raises(NvmlGpuLost):
        reader.read()
    assert nvml.ERROR_COUNTS["gpu_lost"] == before + 1


def test_a_machine_without_nvml_raises_unavailable_not_a_crash():
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlUnavailable as exc:
        assert exc.kind == "unavailable"
        assert nvml.ERROR_COUNTS["unavailable"] >= 1
    else:  # on a GPU machine the same call simply works
        assert count >= 1


def test_missing_pynvml_function_is_not_supported():
    before = nvml.ERROR_COUNTS["not_supported"]
    with pytest.raises(NvmlNotSupported, match="missing from pynvml"):
        nvml.call("nvmlNoSuchFunctionAnywhere")
    assert nvml.ERROR_COUNTS["not_supported"] == before + 1
