"""The step probe on the CPU: HF Trainer and plain-loop adapters over a tiny Llama, the ledger,
and a missing or broken sampler costing training nothing."""

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from collector.probe.core import StepProbe  # noqa: E402
from collector.probe.ledger import LedgerCache, ledger  # noqa: E402
from collector.probe.outbox import Outbox  # noqa: E402
from tests.loops import lightning_fit, plain_loop  # noqa: E402
from workloads import finetune  # noqa: E402


def tiny_args(steps=3):
    return finetune.defaults(
        finetune.parser().parse_args(["--size", "tiny", "--steps", str(steps)])
    )


def test_hf_trainer_gives_one_record_per_step_per_device():
    probe = StepProbe(outbox=Outbox(None))
    summary = finetune.run(tiny_args(3), probe)
    assert len(summary["step_times_s"]) == 3
    assert [r["step"] for r in probe.records] == [1, 2, 3]
    assert {r["device"] for r in probe.records} == {"cpu"}
    last = probe.records[-1]
    assert last["ledger"]["parameters"] == 4 * summary["parameters"]
    assert last["ledger"]["optimizer_state"] >= 2 * last["ledger"]["parameters"]  # AdamW: m, v
    assert last["ledger"]["gradients"] == 0  # HF zero_grad(set_to_none) runs before on_step_end
    kinds = [e["kind"] for e in probe.outbox.events]
    assert kinds[:3] == ["begin", "phase", "end"] and kinds.count("end") == 3


def test_plain_loop_and_hf_records_have_the_same_shape():
    hf = StepProbe(outbox=Outbox(None))
    finetune.run(tiny_args(2), hf)
    plain = StepProbe(outbox=Outbox(None))
    plain_loop(plain, steps=2)
    assert len(plain.records) == 2
    for a, b in zip(hf.records, plain.records, strict=True):
        assert a.keys() == b.keys()
        assert a["ledger"].keys() == b["ledger"].keys()
        assert a["torch"].keys() == b["torch"].keys()
    assert [e["phase"] for e in plain.outbox.events if e["kind"] == "phase"] == ["optimizer"] * 2


def test_without_cuda_the_probe_says_so_once(caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    probe = StepProbe(outbox=Outbox(None))
    with caplog.at_level("WARNING"):
        plain_loop(probe, steps=3)
    assert sum("CUDA is not available" in r.message for r in caplog.records) == 1
    assert all(r["torch"] == {} for r in probe.records)


class DeadActor:
    """A handle whose every call fails, like a sampler actor that died."""

    class _Method:
        def remote(self, *a, **k):
            raise RuntimeError("actor is dead")

    record_events = _Method()


def test_a_dead_sampler_costs_the_run_nothing_and_is_counted(record_fault):
    probe = StepProbe(outbox=Outbox(lambda uuid: DeadActor(), flush_interval_s=0.01))
    plain_loop(probe, steps=3)
    assert len(probe.records) == 3
    assert probe.outbox.dropped["send_failed"] == len(probe.outbox.events)
    assert probe.outbox.sent == 0
    record_fault(
        "every call to the sampler fails (actor dead), tiny Llama training loop",
        "every training step taken; each unsent event counted (send_failed) and kept",
        failed_steps=0,
        events_unsent_counted=probe.outbox.dropped["send_failed"],
    )


def test_a_missing_sampler_is_counted_and_events_are_kept():
    probe = StepProbe(outbox=Outbox(lambda uuid: None))
    plain_loop(probe, steps=2)
    assert probe.outbox.dropped["no_sampler"] == len(probe.outbox.events) == 6


def test_a_stalled_sampler_lookup_never_blocks_the_training_thread(record_fault):
    def slow_resolve(uuid):
        time.sleep(2.0)
        return None

    probe = StepProbe(outbox=Outbox(slow_resolve, flush_interval_s=0.0))
    t0 = time.perf_counter()
    for step in range(1, 51):
        probe.begin(step)
        probe.end()
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0  # 50 steps while the sender is stuck in a 2 s lookup
    probe.outbox.close(timeout=0.1)
    record_fault(
        "the sampler lookup stalls for 2 s (Ray GCS unresponsive)",
        "50 probe steps took no longer than without telemetry; the sender thread waits alone",
        failed_steps=0,
        probe_ms_per_step=round(elapsed / 50 * 1000, 3),
    )


def test_events_file_gets_every_event(tmp_path):
    path = tmp_path / "events.jsonl"
    probe = StepProbe(outbox=Outbox(None, events_file=path))
    plain_loop(probe, steps=2)
    lines = path.read_text().splitlines()
    assert len(lines) == len(probe.outbox.events) == 6


def test_ledger_counts_paged_state_as_managed_on_its_device():
    p = torch.nn.Parameter(torch.zeros(10))
    paged = torch.zeros(1000, dtype=torch.uint8)
    paged.is_paged = True  # what bitsandbytes' get_paged marks on its managed-memory tensors
    paged.page_deviceid = 0

    class Opt:
        def __init__(self):
            self.state = {p: {"state1": paged, "qmap1": torch.zeros(256), "step": 3}}

    by_dev = ledger(None, Opt())
    assert by_dev[torch.device("cuda", 0)]["optimizer_state_managed"] == 1000
    assert by_dev[torch.device("cpu")]["optimizer_state"] == 1024


def test_ledger_cache_redoes_the_full_pass_only_when_state_appears():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    cache = LedgerCache(refresh_steps=100)
    cache.take(model, opt, 1)
    model(torch.ones(1, 4)).sum().backward()
    with_grads = cache.take(model, opt, 2)[torch.device("cpu")]
    assert with_grads["gradients"] == with_grads["parameters"] == 80
    opt.step()
    opt.zero_grad()
    after = cache.take(model, opt, 3)[torch.device("cpu")]
    assert after["optimizer_state"] > 0 and after["gradients"] == 0
    cache.take(model, opt, 4)
    assert cache.full_passes == 2
    cache.take(model, opt, 200)
    assert cache.full_passes == 3


def test_lightning_adapter_gives_the_same_record_shape():
    pytest.importorskip("lightning")
    from collector.probe.lightning import StepMemLightningCallback

    probe = StepProbe(outbox=Outbox(None))
    lightning_fit(StepMemLightningCallback(probe), batches=6, accumulate_grad_batches=2)
    assert [r["step"] for r in probe.records] == [1, 2, 3]
    hf = StepProbe(outbox=Outbox(None))
    finetune.run(tiny_args(1), hf)
    assert probe.records[0].keys() == hf.records[0].keys()
    assert probe.records[0]["ledger"].keys() == hf.records[0]["ledger"].keys()
    # Lightning zeroes gradients at the next step's first backward: they are still held at the end
    assert probe.records[-1]["ledger"]["gradients"] == probe.records[-1]["ledger"]["parameters"]
    assert [e["phase"] for e in probe.outbox.events if e["kind"] == "phase"] == ["optimizer"] * 3


def test_the_outbox_keeps_a_bounded_number_of_events(monkeypatch):
    from collector.model.records import StepEvent
    from collector.probe import outbox

    monkeypatch.setattr(outbox, "EVENTS_KEPT", 10)
    box = Outbox(None)
    for i in range(25):
        box.put(StepEvent(kind="begin", step=i, t_ns=1 + i, gpu_uuid="GPU-a"))
    # the training process keeps only the newest few for inspection: the run keeps them all
    # on the sampler side (events_since), so a long run cannot grow the training process
    assert [e["step"] for e in box.events] == list(range(15, 25))


def test_a_step_that_raises_is_recorded_as_failed_and_the_error_goes_on():
    probe = StepProbe(outbox=Outbox(None))
    with pytest.raises(MemoryError), probe.step(1):
        raise MemoryError("out of memory")
    (end,) = [e for e in probe.outbox.events if e["kind"] == "end"]
    assert end["step"] == 1 and end["phase"] == "error:MemoryError"
    assert probe.step_index is None
    probe.fail(RuntimeError("outside a step"))  # nothing open: nothing recorded
    assert sum(e["kind"] == "end" for e in probe.outbox.events) == 1


def test_a_workload_that_dies_fails_the_job_with_the_step_named():
    from collector.model.settings import JobOptions
    from collector.run.runners import LiveRunner

    ob = Outbox(lambda uuid: None, flush_interval_s=0.01)
    opts = JobOptions(
        workload="patterns",
        workload_args=["--pattern", "leak", "--steps", "4", "--leak-mib", "1", "--base-mib", "4"],
    )
    real, leaks = torch.empty, []

    def empty(*a, **kw):  # the third step's leak allocation fails, as a CUDA OOM would
        if a == ((1 << 20) // 4,):
            leaks.append(1)
            if len(leaks) == 3:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", empty)
        with pytest.raises(torch.OutOfMemoryError):
            LiveRunner(opts).run(ob, lambda *_: None)
    ends = [e for e in ob.events if e["kind"] == "end"]
    assert [(e["step"], e["phase"]) for e in ends] == [
        (1, ""),
        (2, ""),
        (3, "error:OutOfMemoryError"),
    ]


def test_the_job_runs_a_users_script_with_its_arguments(tmp_path):
    """`stepmem run --script train.py -- ARGS`: the script runs as __main__ with its argv, its
    own probe (the three lines a user adds) takes its steps; a non-zero exit fails the job."""
    from collector.model.settings import JobOptions
    from collector.run.runners import ScriptRunner

    script = tmp_path / "train.py"
    script.write_text(
        "import json, sys\n"
        "from collector.probe.core import StepProbe\n"
        "probe = StepProbe()\n"
        "for i in range(1, 4):\n"
        "    with probe.step(i):\n"
        "        pass\n"
        "probe.close()\n"
        "json.dump({'argv': sys.argv[1:], 'name': __name__, 'steps': len(probe.records)},\n"
        "          open(sys.argv[1], 'w'))\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    out = tmp_path / "out.json"
    ob = Outbox(None)
    summary = ScriptRunner(JobOptions(script=script, workload_args=[str(out), "0"])).run(
        ob, lambda *_: None
    )
    assert json.loads(out.read_text()) == {
        "argv": [str(out), "0"],
        "name": "__main__",
        "steps": 3,
    }
    assert summary["script"] == str(script)
    with pytest.raises(RuntimeError, match="exited with status 3"):
        ScriptRunner(JobOptions(script=script, workload_args=[str(out), "3"])).run(
            ob, lambda *_: None
        )


def test_a_bug_in_the_probe_never_reaches_the_training_loop(monkeypatch, caplog):
    """Telemetry never hurts training: an unexpected error inside a mark (a stepmem bug) is
    counted and logged once, and the step goes on."""
    probe = StepProbe(outbox=Outbox(None))

    def broken(*a, **k):
        raise ValueError("a bug")

    monkeypatch.setattr(probe, "_mark", broken)
    for i in (1, 2):
        with probe.step(i):
            pass
    assert probe.errors["internal:ValueError"] == 4  # two begins, two ends
    assert caplog.text.count("the probe's begin failed") == 1


def test_two_probes_in_one_process_never_number_a_step_twice():
    """Train then evaluate, a notebook cell run again: the second probe's steps go on from the
    first's sequence numbers (a step's key is (GPU, pid, seq))."""
    seqs = []
    for _ in range(2):
        probe = StepProbe(outbox=Outbox(None))
        for i in range(1, 4):
            with probe.step(i):
                pass
        seqs += [e["seq"] for e in probe.outbox.events if e["kind"] == "end"]
        probe.close()
    assert len(seqs) == 6 and len(set(seqs)) == 6, seqs


def test_a_process_that_cannot_spool_says_so_and_the_run_learns_it(tmp_path, caplog):
    """D10: a spool write that fails (a full disk; here the file's name is taken by a folder)
    is counted as spool_failed, said once, and marked in the folder, so the run's sampler
    sees the writer that failed and the run says its record is incomplete."""
    import os

    from collector.model.records import SamplerHealth, StepEvent
    from collector.probe.outbox import SpoolReader
    from collector.run.session import spool_problems

    (tmp_path / f"events-{os.getpid()}.jsonl").mkdir()
    out = Outbox(None, spool=tmp_path, flush_interval_s=0.01)
    for i in range(5):
        out.put(StepEvent("begin", i, 1 + i, "GPU-x"))
    out.close()
    assert out.dropped["spool_failed"] == 5 and out.dropped["no_sampler"] == 0
    assert sum("cannot write step events" in r.message for r in caplog.records) == 1
    reader = SpoolReader(tmp_path, "GPU-x")
    reader.read()
    assert reader.failed_writers == 1
    one = SamplerHealth(spool_failed_writers=1)
    (line,) = spool_problems([one, one], "S")
    assert line.startswith("1 process(es) could not write their step events")


def test_a_full_spool_disk_costs_the_probes_close_nothing(tmp_path, caplog):
    """D10's rest: a spool on a full disk (its file is /dev/full: every write ENOSPC) made the
    probe's close print a 13-line traceback, from the file's close flushing what the failed
    write left buffered. The close is quiet now: said once, counted, marked."""
    import os

    from collector.probe.core import StepProbe

    os.symlink("/dev/full", tmp_path / f"events-{os.getpid()}.jsonl")
    probe = StepProbe(outbox=Outbox(None, spool=tmp_path, flush_interval_s=0.01))
    for i in range(1, 4):
        with probe.step(i):
            pass
    probe.close()
    assert not probe.errors, probe.errors
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert probe.outbox.dropped["spool_failed"] >= 1
    assert sum("cannot write step events" in r.message for r in caplog.records) == 1


def test_two_runs_with_one_run_id_never_share_a_spool_folder():
    """D8, D11: the spool folder is the run instance's, not the run id's."""
    from collector.run.job import spool_dir

    a, b = spool_dir("nightly"), spool_dir("nightly")
    assert a != b and a.parent == b.parent and a.name.startswith("nightly-")


_USER_PEAKS = """
import torch, torch.cuda.memory as mem
# the caching allocator's peak statistics, as torch keeps them (CI has no GPU)
state = {"current": 0, "peak": 0}
def nested(device=None):
    return {"allocated_bytes": {"all": {"current": state["current"], "peak": state["peak"]}}}
def reset(device=None):
    state["peak"] = state["current"]
def alloc(n):
    state["current"] += n
    state["peak"] = max(state["peak"], state["current"])
mem.memory_stats_as_nested_dict = torch.cuda.memory_stats_as_nested_dict = nested
mem.reset_peak_memory_stats = torch.cuda.reset_peak_memory_stats = reset
from collector.probe.peaks import user_peaks
keeper = user_peaks()
seen = []
torch.cuda.reset_peak_memory_stats()          # the user's own reset, before the loop
for step in range(3):
    alloc(100); alloc(-100)                    # a transient of 100 in the step
    n = keeper.real_stats(None); keeper.carry(None, n); keeper.real_reset(None)  # the probe's mark
    alloc(10)                                  # what the step keeps
    seen.append(torch.cuda.max_memory_allocated())
probe_view = keeper.real_stats(None)["allocated_bytes"]["all"]["peak"]
torch.cuda.reset_peak_memory_stats()          # the user's reset clears the carried peak too
print(seen, probe_view, torch.cuda.max_memory_allocated())
"""


def test_the_probes_resets_leave_the_users_own_peak_counters_alone():
    """F6: adding the probe reset torch's peaks at every mark, so a loop printing its own
    max_memory_allocated() saw the end-of-step value (4.43 GiB for a 9.07 GiB peak). The probe
    keeps what it reset away: the user's view is the peak since the user's own reset, while the
    probe reads torch's (since its last mark)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _USER_PEAKS], capture_output=True, text=True,
                         timeout=120, cwd=str(Path(__file__).parent.parent))  # fmt: skip
    assert out.returncode == 0, out.stderr
    # the user's peak: 100, then 110 (10 kept + the 100 transient), 120; the probe's: since
    # its last mark only (30 now held); after the user's own reset: what is held now
    assert out.stdout.split() == ["[100,", "110,", "120]", "30", "30"], out.stdout
