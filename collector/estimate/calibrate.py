"""``stepmem devices --calibrate``: what a training process holds on this GPU outside torch's
allocator, measured — the figure an estimate adds to torch's reserved bytes to predict NVML.

A child process (so that nothing of this one's CUDA state counts) creates the CUDA context, then
trains a small Llama for two steps as the estimated loop does (bf16 autocast, checkpointing,
attention, AdamW's foreach step: the kernels and cuBLAS handles a training step loads on first
use), and reports torch's reserved bytes at two moments: right after the context exists and
after the steps. This process reads NVML's used memory of the GPU at the same moments; the
difference, less what the GPU held before the child started, is the process's memory outside
torch. The GPU should be otherwise idle (another process's memory would count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from collector.estimate.gpus import Calibration

__all__ = ["calibrate"]

CHILD_TIMEOUT_S = 300.0
_CHILD = r"""
import json, sys, torch
dev = torch.device("cuda", int(sys.argv[1]))
torch.cuda.set_device(dev)
torch.zeros(1, device=dev)
torch.cuda.synchronize(dev)
print(json.dumps({"at": "context", "reserved": torch.cuda.memory_reserved(dev)}), flush=True)
sys.stdin.readline()
from collector.estimate.spec import Spec
import collector.estimate.build as build
spec = Spec(size="small", seq_len=256, batch=2, grad_accum=2)
with dev:
    model = build.build_model(spec)
model.gradient_checkpointing_enable()
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
for _ in range(2):
    for _ in range(2):
        ids = torch.randint(0, 32000, (2, 256), device=dev)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize(dev)
print(json.dumps({"at": "trained", "reserved": torch.cuda.memory_reserved(dev),
                  "torch": torch.__version__, "cuda": torch.version.cuda}), flush=True)
sys.stdin.readline()
"""


def _used(handle: Any) -> int:
    """NVML's used bytes; v2's where the driver has it (v1's also count what the driver keeps)."""
    import pynvml

    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used)
    except (pynvml.NVMLError, AttributeError, TypeError):
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def _settled(handle: Any) -> int:
    """NVML used once two reads 50 ms apart agree (the driver's accounting lags a little)."""
    last = _used(handle)
    for _ in range(40):
        time.sleep(0.05)
        now = _used(handle)
        if now == last:
            return now
        last = now
    return last


def calibrate(index: int = 0, say: Any = print) -> Calibration:
    """Measure GPU ``index`` (see the module doc); raises ``RuntimeError`` when the child fails."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        before = _settled(handle)
        say(f"calibrating {name} (GPU {index}, driver {driver}): {before / 2**30:.2f} GiB in use")
        child = subprocess.Popen(  # the same environment: CUDA's index is NVML's unless
            [sys.executable, "-c", _CHILD, str(index)],  # CUDA_VISIBLE_DEVICES reorders them
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        try:
            start = _reading(child, "context")
            at_start = _settled(handle) - before - start["reserved"]
            say(f"CUDA context: {at_start / 2**30:.2f} GiB outside torch; training two steps")
            child.stdin.write("\n")
            child.stdin.flush()
            end = _reading(child, "trained")
            outside = _settled(handle) - before - end["reserved"]
            child.stdin.write("\n")
            child.stdin.flush()
            child.wait(timeout=CHILD_TIMEOUT_S)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    finally:
        pynvml.nvmlShutdown()
    return Calibration(
        gpu=name,
        outside_torch=max(0, outside),
        at_start=max(0, min(at_start, outside)),
        driver=driver,
        cuda=str(end.get("cuda") or ""),
        torch=str(end.get("torch") or ""),
        source=f"stepmem devices --calibrate, {time.strftime('%Y-%m-%d')}",
    )


def _reading(child: subprocess.Popen, at: str) -> dict[str, Any]:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the calibration child exited (code {child.wait()}) before {at}")
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(d, dict) and d.get("at") == at:
            return d
    raise RuntimeError(f"the calibration child did not reach {at} in {CHILD_TIMEOUT_S:.0f} s")
