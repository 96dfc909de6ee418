"""The sampling thread and the step join, with small fake devices (no NVML needed)."""

import threading
import time

import pytest

from collector.model.records import ProcessMemory
from collector.model.settings import Rate
from collector.nvml import NvmlUnknown
from collector.sampler import RingBuffer, Sampler
from tests.conftest import wait_for
from tests.joins import MS, CountingDevice, ev, joiner_with


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "abc", "", "2e6"])
def test_bad_rates_are_rejected_with_the_reason(text):
    with pytest.raises(ValueError, match="rate"):
        Rate.parse(text)


def test_rates_parse():
    assert Rate.parse("max") == Rate.MAX
    assert Rate.parse("1000").hz == 1000.0
    assert Rate.parse(250).hz == 250.0


def test_sampler_keeps_its_schedule_and_records_real_timestamps():
    s = Sampler(CountingDevice(), rate=500, capacity=4096)
    s.start()
    time.sleep(0.6)
    s.stop()
    snap = s.ring.snapshot()
    assert not s.alive
    # 0.6 s at 500 Hz is 300 samples; a loaded CI machine may lose some, never gain.
    assert 150 <= len(snap) <= 305
    gaps = snap.t_ns[1:] - snap.t_ns[:-1]
    assert gaps.min() > 0
    assert abs(float(sorted(gaps)[len(gaps) // 2]) - 2_000_000) < 500_000  # median ≈ 2 ms


def test_errors_are_counted_by_kind_and_sampling_goes_on():
    s = Sampler(CountingDevice(fail_every=3, fail_with=NvmlUnknown), rate=2000, capacity=4096)
    s.start()
    wait_for(lambda: s.errors["unknown"] >= 5, timeout=10)
    s.stop()
    assert s.alive is False
    assert len(s.ring) >= 10  # the other two thirds of the reads landed
    assert set(s.errors) == {"unknown"}


def test_a_lost_gpu_stops_the_loop_and_says_why():
    s = Sampler(CountingDevice(lose_after=20), rate=Rate.MAX, capacity=4096)
    s.start()
    wait_for(lambda: not s.alive, timeout=10)
    assert s.stopped_by == "gpu_lost"
    assert s.errors["gpu_lost"] == 1
    assert len(s.ring) == 20


def test_stop_is_prompt_even_at_a_slow_rate():
    s = Sampler(CountingDevice(), rate=0.5, capacity=16)
    s.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    s.stop()
    assert time.monotonic() - t0 < 0.5


def test_max_rate_samples_back_to_back():
    s = Sampler(CountingDevice(), rate=Rate.MAX, capacity=1 << 16)
    s.start()
    time.sleep(0.2)
    s.stop()
    assert s.ring.count > 1000  # far above any fixed rate we would configure for a test


# -- the join ----------------------------------------------------------------------------------


def test_join_takes_peak_min_time_and_end_reading():
    samples = [(t * MS, 10) for t in range(1, 100)]
    samples[40] = (41 * MS, 50)  # the within-step peak at 41 ms
    samples[60] = (61 * MS, 3)
    j = joiner_with(samples)
    j.add(ev("begin", 1, 30 * MS))
    j.add(ev("end", 1, 70 * MS, **{"allocated_bytes.all.peak": 9}))
    (rec,) = j.poll()
    assert (rec.nvml_peak_bytes, rec.nvml_peak_t_ns, rec.nvml_min_bytes) == (50, 41 * MS, 3)
    assert rec.samples == 41 and rec.gap == ""
    assert rec.nvml_end_bytes == 10 and rec.nvml_reserved_bytes == 100
    assert rec.torch_allocated_peak_bytes == 9


def test_end_reading_sees_a_release_just_before_the_end_mark():
    # A cache released just before the end mark shows in the first sample after it (1 ms on)
    j = joiner_with([(10 * MS, 5), (20 * MS, 90), (26 * MS, 5)])
    j.add(ev("begin", 1, 10 * MS))
    j.add(ev("end", 1, 25 * MS))
    (rec,) = j.poll()
    assert rec.nvml_peak_bytes == 90 and rec.nvml_end_bytes == 5


def test_a_late_sample_after_the_end_mark_is_not_the_end_reading():
    # a stalled sampler's first sample after the mark comes 12 ms late, after a release that
    # followed the mark: the end reading is the last sample inside the step
    j = joiner_with([(10 * MS, 5), (20 * MS, 90), (37 * MS, 5)])
    j.add(ev("begin", 1, 10 * MS))
    j.add(ev("end", 1, 25 * MS))
    (rec,) = j.poll()
    assert rec.nvml_end_bytes == 90


def test_end_reading_never_holds_the_next_steps_first_allocation():
    # step 2 begins 2 ms after step 1 ends and allocates at once: the first sample after
    # step 1's end mark is step 2's, so step 1 ends at its last sample inside it
    j = joiner_with([(10 * MS, 5), (20 * MS, 40), (27 * MS, 90), (40 * MS, 90)])
    j.add(ev("begin", 1, 10 * MS))
    j.add(ev("end", 1, 25 * MS))
    j.add(ev("begin", 2, 26 * MS))
    (rec,) = j.poll()
    assert rec.nvml_end_bytes == 40 and rec.nvml_end_bytes <= rec.nvml_peak_bytes


def test_a_step_is_joined_only_once_the_sampler_has_passed_its_end():
    j = joiner_with([(t * MS, 1) for t in range(10)])
    j.add(ev("begin", 1, 5 * MS))
    j.add(ev("end", 1, 20 * MS))
    assert j.poll() == [] and j.pending == 1
    assert len(j.poll(force=True)) == 1 and j.pending == 0


def test_phases_get_their_own_peaks():
    samples = [(t * MS, 10 + (40 if t == 15 else 0) + (70 if t == 35 else 0)) for t in range(60)]
    j = joiner_with(samples)
    j.add(ev("begin", 2, 10 * MS))
    j.add(ev("phase", 2, 30 * MS, "optimizer", **{"allocated_bytes.all.peak": 400}))
    j.add(ev("end", 2, 50 * MS, **{"allocated_bytes.all.peak": 700}))
    (rec,) = j.poll()
    fb, opt = rec.phases
    assert (fb.phase, fb.nvml_peak_bytes, fb.torch_allocated_peak_bytes) == (
        "forward_backward",
        50,
        400,
    )
    assert (opt.phase, opt.nvml_peak_bytes, opt.torch_allocated_peak_bytes) == (
        "optimizer",
        80,
        700,
    )
    assert rec.torch_allocated_peak_bytes == 700


@pytest.mark.parametrize(
    ("samples", "capacity", "started", "expected"),
    [
        ([(t * MS, 1) for t in range(100)], 1024, 1, ""),
        # a 40 ms hole in a 50 ms step: a stall, and fewer than half the samples 1 kHz promises
        ([(t * MS, 1) for t in (*range(20), *range(60, 100))], 1024, 1, "stall undersampled"),
        # a 7 ms hole in a 50 ms step that got most of its samples: a transient may hide there
        ([(t * MS, 1) for t in (*range(50), *range(57, 100))], 1024, 1, "hole"),
        ([(t * MS, 1) for t in range(100)], 32, 1, "overrun undersampled"),
        # the last sample 10 ms before the end mark, none after: the end reading is stale, and
        # those 10 ms are a hole a transient could hide in
        ([(t * MS, 1) for t in range(71)], 1024, 1, "hole stale_end"),
        # a sample just before the end mark, the next 15 ms after it (a starved sampler): a
        # release between the two would not show, so the end reading is flagged too
        ([(t * MS, 1) for t in (*range(80), 95)], 1024, 1, "stale_end"),
        ([(t * MS, 1) for t in range(100)], 1024, 35 * MS, "sampler_started"),
        ([(t * MS, 1) for t in (*range(10), *range(90, 100))], 1024, 1, "no_samples"),
    ],
)
def test_gaps_are_flagged(samples, capacity, started, expected):
    j = joiner_with(samples, capacity=capacity, started_ns=started)
    j.add(ev("begin", 1, 30 * MS))
    j.add(ev("end", 1, 80 * MS))
    (rec,) = j.poll(force=True)
    assert rec.gap == expected


def test_unpaired_events_are_counted_not_joined():
    j = joiner_with([(t * MS, 1) for t in range(10)])
    j.add(ev("end", 4, 5 * MS))
    j.add(ev("phase", 5, 5 * MS, "optimizer"))
    j.add(ev("begin", 6, 8 * MS))
    j.add(ev("end", 6, 3 * MS))
    assert j.poll(force=True) == []
    assert dict(j.rejected) == {
        "end_without_begin": 1,
        "phase_without_begin": 1,
        "end_before_begin": 1,
    }


def test_concurrent_reader_never_sees_torn_windows():
    ring = RingBuffer(64)
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            ring.append(i, i, i)
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(500):
            w, _ = ring.since(max(0, ring.count - 64))
            assert (w.t_ns == w.used).all() and (w.used == w.reserved).all()
            if len(w) > 1:
                assert ((w.t_ns[1:] - w.t_ns[:-1]) == 1).all()
    finally:
        stop.set()
        t.join()


def test_the_joiner_keeps_a_bounded_number_of_records():
    from collector import join as sampler_module

    j = joiner_with([(t * MS, 1) for t in range(100)])
    j.records = sampler_module.deque(maxlen=5)
    for s in range(1, 21):
        j.add(ev("begin", s, s * MS))
        j.add(ev("end", s, s * MS + MS // 2))
    j.poll()
    assert [r.step for r in j.records] == list(range(16, 21)) and j.joined == 20


def test_a_failed_step_keeps_its_record_with_the_error():
    j = joiner_with([(t * MS, 10) for t in range(1, 40)])
    j.add(ev("begin", 3, 5 * MS))
    j.add(ev("end", 3, 20 * MS, phase="error:OutOfMemoryError", num_ooms=1))
    (rec,) = j.poll()
    assert rec.error == "OutOfMemoryError" and rec.torch_end["num_ooms"] == 1
    j.add(ev("begin", 4, 21 * MS))
    j.add(ev("end", 4, 30 * MS))
    (ok,) = j.poll()
    assert ok.error == ""


def test_a_step_without_samples_has_no_nvml_figures_not_zero_bytes():
    # The sampler read nothing between 10 ms and 90 ms: the step's NVML figures are unknown.
    j = joiner_with([(t * MS, 7 << 30) for t in (*range(10), *range(90, 100))])
    j.add(ev("begin", 1, 30 * MS))
    j.add(ev("end", 1, 60 * MS))
    (rec,) = j.poll(force=True)
    assert rec.gap == "no_samples" and rec.samples == 0
    assert rec.nvml_peak_bytes is None and rec.nvml_min_bytes is None
    assert rec.nvml_peak_t_ns is None
    assert rec.nvml_end_bytes is None and rec.nvml_reserved_bytes is None


def test_a_stand_in_step_takes_nothing_from_the_capture_playing_beside_it():
    """CPU processes standing in for a replayed GPU (``run --backend replay --command``): the
    capture's samples (its idle lead-in's 0 bytes, its loop) are not their memory — no NVML
    figure, gap ``stand_in``; the phases and the torch side are still the step's own."""
    from collector.analysis.diagnosis import diagnose, verdict

    def steps(stand_in: bool):
        j = joiner_with([(t * MS, 7 << 30 if t % 7 else 0) for t in range(100)])
        j.stand_in = stand_in
        for k in (1, 2, 3):
            j.add(ev("begin", k, (25 * k - 20) * MS))
            j.add(ev("phase", k, (25 * k - 10) * MS, "optimizer"))
            j.add(ev("end", k, 25 * k * MS))
        return j.poll(force=True)

    recs = steps(stand_in=True)
    for rec in recs:
        assert rec.gap == "stand_in" and rec.samples == 0 and not rec.measured
        assert rec.nvml_peak_bytes is None and rec.nvml_end_bytes is None
        assert [p.phase for p in rec.phases] == ["forward_backward", "optimizer"]
        assert all(p.nvml_peak_bytes is None for p in rec.phases)
    found = diagnose(recs, total_bytes=140 << 30)
    assert verdict(found)[0].startswith("No NVML figure: CPU processes stood in for the GPU")
    assert not [f for f in found if f.rule in ("headroom", "steady_state", "transient", "unsteady")]
    measured = steps(stand_in=False)  # the same steps joined as a GPU's: the capture's figures
    assert "headroom" in {f.rule for f in diagnose(measured, total_bytes=140 << 30)}


def test_records_are_read_safely_while_the_join_thread_polls():
    """The run store drains records through a Ray call while the actor's join thread polls and
    appends: reading must neither raise ("deque mutated during iteration") nor skip a step."""
    j = joiner_with([(t * MS, 1) for t in range(100)])
    steps = 20_000
    done = threading.Event()
    errors: list[BaseException] = []

    def produce():
        try:
            for s in range(1, steps + 1):
                j.add(ev("begin", s, 1 * MS))
                j.add(ev("end", s, 2 * MS))
                if s % 50 == 0:
                    j.poll()
            j.poll()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=produce)
    t.start()
    seen: list[int] = []
    cursor = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        finished = done.is_set()
        recs, cursor, lost = j.records_since(cursor)
        new = [r.step for r in recs]
        assert new == sorted(new) and lost == 0
        seen += new
        if finished:
            break
    t.join()
    assert not errors
    assert seen == list(range(1, steps + 1))


class _ProcsDevice:
    """Per-process readings of a fake GPU whose used memory the test sets."""

    uuid = "GPU-test"
    backend = "nvml"

    def __init__(self):
        self.used, self.calls, self.fail = 100 * MIB, 0, False

    def processes_reading(self, t_ns):

        self.calls += 1
        if self.fail:
            raise NvmlUnknown("injected")
        return t_ns, self.used, [ProcessMemory(pid=7, used_bytes=self.used, name="train")]


MIB = 1 << 20


def test_process_watch_reads_when_memory_moves_and_serves_the_reading_that_fits_a_step_end():
    from collector.procwatch import ProcessWatch

    dev = _ProcsDevice()
    s = Sampler(CountingDevice(), rate=1000, capacity=64)
    w = ProcessWatch(dev, s, heartbeat_s=3600)

    def sample(used):
        t = time.monotonic_ns()
        s.ring.append(t, used, 0)
        return t

    sample(100 * MIB)
    assert w.poll()  # the first reading
    sample(101 * MIB)
    assert not w.poll()  # moved less than a page: nothing read
    end1 = sample(100 * MIB)  # step 1 ends here
    dev.used = 600 * MIB
    sample(600 * MIB)  # the next step allocates 500 MiB
    assert w.poll() and dev.calls == 2
    # step 1 ended with 100 MiB used: the reading before its end fits, not the one after
    r = w.reading_for(end1, 100 * MIB)
    assert r.device_used == 100 * MIB and r.procs == [ProcessMemory(7, 100 * MIB, "train")]
    # a step that ended with 600 MiB used just before the reading: the one after fits
    assert w.reading_for(end1, 600 * MIB).device_used == 600 * MIB
    # an NVML error is counted, and costs nothing else
    dev.fail = True
    sample(900 * MIB)
    assert not w.poll() and w.errors == {"NvmlUnknown": 1} and w.reads == 2


def test_unended_steps_and_phase_marks_cannot_grow_a_sampler():
    from collector import join as smp
    from collector.model.records import StepEvent
    from tests.joins import joiner_with

    j = joiner_with([(t * 1_000_000, 1) for t in range(10)])
    for pid in range(smp.MAX_OPEN + 500):  # begins without ends, one per process
        j.add(StepEvent("begin", 1, 1 + pid, "GPU-test", seq=1, pid=pid))
    assert j.open_steps == smp.MAX_OPEN and j.rejected["open_dropped"] == 500
    assert 7 not in j._open  # the oldest processes' open steps went first
    last = smp.MAX_OPEN + 499
    for k in range(smp.MAX_PHASES + 100):  # phase marks of one open step
        j.add(StepEvent("phase", 1, 5000 + k, "GPU-test", phase=f"p{k}", seq=1, pid=last))
    assert len(j._open[last][2]) == smp.MAX_PHASES and j.rejected["phases_dropped"] == 100
    far = StepEvent(
        "end", 1, time.monotonic_ns() + 2 * smp.MAX_FUTURE_NS, "GPU-test", seq=1, pid=last
    )
    j.add(far)
    assert j.rejected["future_timestamp"] == 1 and j.pending == 0
