"""Every ``torch.cuda`` call the adversarial trial's script made (17 of its 35 raised on the CPU
stand-in before), run inside every probe step. Under ``stepmem estimate --script`` each answers
(without a GPU, from the stand-ins); on a GPU it runs as written. ``--json`` prints torch's
counters after step 2 (real on a GPU, the estimate's under it).

    python benchmarks/scripts/cuda_calls.py SNAPSHOT.pickle [--json]
"""

import json
import sys

import torch

from collector.probe.core import StepProbe

dev = torch.device("cuda")
m = torch.nn.Linear(256, 256).to(dev)
opt = torch.optim.AdamW(m.parameters())
scaler = torch.amp.GradScaler("cuda")
side = torch.cuda.Stream()
torch.cuda.memory._record_memory_history(max_entries=1000)
probe = StepProbe().watch(m, opt)
for i in range(3):
    with probe.step(i):
        torch.cuda.set_per_process_memory_fraction(0.5)
        assert torch.cuda.get_per_process_memory_fraction() == 0.5
        free, total = torch.cuda.mem_get_info()
        assert 0 < free < total
        assert torch.cuda.get_device_properties(0).total_memory > 0
        assert torch.cuda.device_count() == 1 and torch.cuda.is_available()
        torch.cuda.manual_seed_all(0)
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda.nvtx.range_push("step")
        torch.cuda.nvtx.mark("here")
        with torch.cuda.device(0), torch.cuda.stream(side):
            x = torch.randn(64, 256, device=dev)
        torch.cuda.current_stream().wait_stream(side)
        side.synchronize()
        with torch.cuda.nvtx.range("fwd"):
            loss = m(x.to(dev, non_blocking=True)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        torch.cuda.nvtx.range_pop()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        print("ms", start.elapsed_time(end), file=sys.stderr)
        rng = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(rng)
        assert rng.numel() == 16 and torch.cuda.get_rng_state_all()[0].numel() == 16
        p = torch.cuda.caching_allocator_alloc(1 << 20)
        torch.cuda.caching_allocator_delete(p)
        torch.cuda.ipc_collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(torch.cuda.utilization(), torch.cuda.temperature(), file=sys.stderr)
        print(torch.cuda.power_draw(), torch.cuda.clock_rate(), file=sys.stderr)
        print(torch.cuda.list_gpu_processes(), file=sys.stderr)
        print(torch.cuda.memory_summary(), file=sys.stderr)
        segs = torch.cuda.memory_snapshot()
        assert sum(s["allocated_size"] for s in segs) == torch.cuda.memory_allocated() > 0
        assert torch.cuda.memory_stats()["allocation.all.current"] > 0
        torch.cuda.memory._dump_snapshot(sys.argv[1])
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = m(x)
        g.replay()
        torch.cuda.synchronize()
        assert not torch.cuda.is_current_stream_capturing()
        a = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
        x = torch.randn(4, 256, device="cuda:0")
    if i == 1 and "--json" in sys.argv:
        s = torch.cuda.memory_stats()
        keys = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "allocation.all.allocated")
        print("counters", json.dumps({k: s[k] for k in keys}), file=sys.stderr)
