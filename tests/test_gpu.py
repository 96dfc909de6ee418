"""On a real GPU only (marked ``gpu``; skipped cleanly elsewhere): live NVML and the CUDA probe."""

import pytest

from collector.nvml import LiveBackend, NvmlError

try:
    _DEVICES = LiveBackend().devices()
except NvmlError:
    _DEVICES = []

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _DEVICES, reason="needs NVML and at least one GPU"),
]


def test_live_device_is_opened_by_uuid_and_reads_v2():
    info = _DEVICES[0]
    dev = LiveBackend().open(info.uuid)
    mem = dev.memory()
    assert dev.uuid == info.uuid and mem.total == info.total_bytes
    assert mem.used + mem.reserved + mem.free == mem.total
    if dev.memory_info_version == 2:
        assert mem.reserved > 0


def test_cuda_and_nvml_agree_on_the_uuid():
    torch = pytest.importorskip("torch")
    from collector.probe.identity import cuda_uuid

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    assert cuda_uuid(0) in {d.uuid for d in _DEVICES}


def test_probe_reads_allocator_statistics_on_cuda():
    torch = pytest.importorskip("torch")
    from collector.probe.core import TORCH_KEYS, StepProbe
    from collector.probe.outbox import Outbox

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    probe = StepProbe(devices=[0], outbox=Outbox(None))
    with probe.step(1):
        x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        del x
    probe.close()
    (rec,) = probe.records
    assert set(TORCH_KEYS) <= rec["torch"].keys()
    assert rec["torch"]["allocated_bytes.all.peak"] >= 256 << 20
