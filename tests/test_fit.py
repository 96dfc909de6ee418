"""Will it fit (#29): what the GPU will hold, predicted without a GPU and held against what the
H200 measured and estimated (committed under ``benchmarks/results/fit``); CUDA's rules on the
CPU held to the H200's answers and to the installed torch's own tables; a card, a margin, a
memory fraction and the search for the largest batch; bad input refused in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from collector.estimate import Spec, cuda_rules, estimate, render
from collector.estimate.fit import Target, limit_of
from collector.estimate.gpus import DRIVER_RESERVED, card, load_calibrations, save_calibration
from collector.estimate.largest import largest
from collector.model.errors import EstimateError
from collector.model.prediction import Estimate, Fit, load_estimate

ROOT = Path(__file__).resolve().parent.parent
FIT = ROOT / "benchmarks" / "results" / "fit"
GIB = 1 << 30

sys.path.insert(0, str(ROOT))
from benchmarks.fit import ROWS, measured  # noqa: E402


def _cli(*argv: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "collector.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def _peaks(est: dict) -> dict[str, int]:
    steps = est["steps"]
    reserved = max(s["reserved_peak"] for s in steps)
    return {
        "allocated": max(s["allocated_peak"] for s in steps),
        "reserved": reserved,
        "nvml": reserved + est["outside_torch"] + est["optimizer_state_managed"],
    }


@pytest.mark.parametrize("run", ["h200-fit-gpt2", "h200-fit-qwen2"])
def test_the_cpu_estimate_equals_the_h200s_and_what_it_measured(run, tmp_path):
    """The same command without a GPU gives the H200's fake-CUDA estimate within 1 % (a model
    without checkpointing and with dropout; a grouped-KV model of another family), and NVML's
    within-step peak the H200 measured within 3 %."""
    flags = next(f for _n, r, f in ROWS if r == run)
    out = tmp_path / "e.json"
    r = _cli("estimate", *flags, "--gpu", "H200", "--margin", "0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    cpu = json.loads(out.read_text())
    gpu = json.loads((FIT / "predicted" / "gpu" / f"{run}.json").read_text())
    assert cpu["stand_in"] and not gpu["stand_in"]
    for k, v in gpu["at_end"].items():  # the tracker rounds CUDA storages to 512 B, not CPU's
        assert abs(cpu["at_end"][k] - v) <= 1 << 20, (k, cpu["at_end"][k], v)
    assert cpu["at_end"]["parameters"] == gpu["at_end"]["parameters"]
    for k, v in _peaks(gpu).items():
        assert abs(_peaks(cpu)[k] - v) <= 0.01 * v, (k, _peaks(cpu)[k], v)
    real = measured(run)
    assert abs(_peaks(cpu)["nvml"] - real["nvml"]) <= 0.03 * real["nvml"]
    assert cpu["fit"]["fits"] and cpu["card"]["name"] == "NVIDIA H200"


def test_the_committed_h200_estimates_are_within_3_percent_of_every_measured_row():
    """The benchmark's GPU side as committed: NVML's peak predicted within 3 % on all six
    rows (what `benchmarks/fit.py table` prints)."""
    for _name, run, _flags in ROWS:
        est = json.loads((FIT / "predicted" / "gpu" / f"{run}.json").read_text())
        real = measured(run)
        err = (_peaks(est)["nvml"] - real["nvml"]) / real["nvml"]
        assert abs(err) <= 0.03, (run, err)


def test_the_attention_rules_give_the_h200s_choice_for_every_layout():
    d = json.loads((FIT / "sdpa-choices.json").read_text())
    assert d["gpu"] == "NVIDIA H200" and len(d["choices"]) >= 200
    wrong = [
        c
        for c in d["choices"]
        if cuda_rules.cuda_sdpa_choice(
            getattr(torch, c["dtype"]), c["head_dim"], c["mask"], c["dropout"], c["gqa"]
        )
        != c["choice"]
    ]
    assert wrong == []


def _header_ops(macro: str) -> set[tuple[str, str]]:
    text = (Path(torch.__file__).parent / "include/ATen/autocast_mode.h").read_text()
    start = text.index(f"#define {macro}(_)")
    body = text[start : text.index("\n\n", start)]
    return {(m[0], m[1] or "") for m in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body)}


@pytest.mark.parametrize(
    ("macro", "table"),
    [
        ("AT_FORALL_LOWER_PRECISION_FP", cuda_rules.CUDA_LOWER_PRECISION),
        ("AT_FORALL_FP32_SET_OPT_DTYPE", cuda_rules.CUDA_FP32_SET_OPT_DTYPE),
    ],
)
def test_cuda_autocast_tables_are_the_installed_torchs(macro, table):
    if not (Path(torch.__file__).parent / "include/ATen/autocast_mode.h").exists():
        pytest.skip("this torch ships no ATen headers")
    assert _header_ops(macro) == set(table)


def test_fp32_autocast_list_covers_the_installed_torchs():
    if not (Path(torch.__file__).parent / "include/ATen/autocast_mode.h").exists():
        pytest.skip("this torch ships no ATen headers")
    names = {n for n, _ in cuda_rules.CUDA_FP32}
    assert {n for n, _ in _header_ops("AT_FORALL_FP32")} <= names


def test_dropout_keeps_cudas_one_byte_mask_on_the_cpu():
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved: list[torch.dtype] = []

    def keep(t):
        saved.append(t.dtype)
        return t

    with FakeTensorMode():
        x = torch.randn(64, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            torch.nn.functional.dropout(x, 0.1, True)
        cpu_saved = list(saved)
        saved.clear()
        with cuda_rules.cuda_dropout(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            torch.nn.Dropout(0.1).train()(x)
    assert torch.float32 in cpu_saved  # the CPU's noise tensor, the input's dtype
    assert saved == [torch.bool]  # native_dropout: CUDA's fused kernel and its mask
    assert torch.nn.functional.dropout.__name__ == "dropout"  # put back


def _tiny(**kw) -> Spec:
    return Spec.for_machine(False, size="tiny", **kw)


def test_a_card_too_small_says_where_the_step_first_runs_out():
    c = card("1.6")
    est = estimate(_tiny(seq_len=512, batch=64), target=Target(c, margin=0.0))
    assert est.fit is not None and not est.fit.fits
    assert est.fit.limit == limit_of(c) == c.capacity - DRIVER_RESERVED - c.outside_torch
    assert est.fit.short == est.reserved_peak - est.fit.usable > 0
    assert re.match(r"\d (forward|backward|optimizer)", est.fit.phase), est.fit
    assert est.fit.request > 0
    text = render(est)
    assert "Does not fit" in text and f"step {est.fit.phase[0]}'s" in text


def test_a_margin_and_a_memory_fraction_lower_what_torch_may_reserve():
    c = card("H100-80GB")
    plain, kept = Target(c), Target(c, margin=0.1)
    assert kept.usable == int(plain.limit * 0.9)
    half = Target(c, fraction=0.5)
    assert half.limit == int(0.5 * (c.capacity - c.driver_reserved))
    est = estimate(_tiny(), target=half)
    assert est.fit.fits and est.fit.fraction == 0.5
    assert est.fit.headroom == half.usable - est.reserved_peak
    back = Estimate.from_dict(json.loads(json.dumps(est.to_dict())))
    assert back.fit == est.fit and back.card == est.card


def _linear(need0: int, per: int, usable: int, retry_slack: int = 0):
    """A stand-in trace: the step needs need0 + per × batch; one within retry_slack above the
    usable bytes still fits by freeing the cache (as the allocator's retry does)."""
    calls: list[int] = []

    def trace(spec: Spec) -> Estimate:
        calls.append(spec.batch)
        need = need0 + per * spec.batch
        e = Estimate(spec={}, device="cpu", stand_in=True, parameters_count=0, steady={},
                     first={}, at_end={})  # fmt: skip
        e.fit = Fit(fits=need <= usable + retry_slack, need=need)
        return e

    return trace, calls


@pytest.mark.parametrize("slack", [0, 3 * GIB])
def test_the_largest_batch_is_traced_and_the_next_one_does_not_fit(slack):
    usable = 70 * GIB
    trace, calls = _linear(20 * GIB, GIB + 123, usable, slack)
    _est, search = largest(_tiny(), "batch", _Usable(Target(card("80")), usable), trace)
    best = max(b for b in calls if 20 * GIB + (GIB + 123) * b <= usable + slack)
    assert search.largest == best and search.converged
    assert best + 1 in calls  # the one above was traced, and does not fit
    assert len(calls) <= (5 if slack == 0 else 9), calls


class _Usable:
    """A target whose usable bytes are given (the search reads ``usable`` and ``margin``)."""

    def __init__(self, target: Target, usable: int) -> None:
        self.card, self.margin, self.usable = target.card, target.margin, usable


def test_max_batch_on_a_small_card_is_the_largest_that_fits(tmp_path):
    out = tmp_path / "e.json"
    r = _cli(
        "estimate", "--size", "tiny", "--seq-len", "512", "--gpu", "1.8", "--margin", "0",
        "--max-batch", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    est = load_estimate(out)
    b = est.largest.largest
    assert est.spec["batch"] == b and est.fit.fits and b > 1
    target = Target(card("1.8"), margin=0.0)
    above = estimate(_tiny(seq_len=512, batch=b + 1), target=target)
    assert not above.fit.fits  # an independent trace of the next size runs out
    assert f"Largest micro-batch that fits: {b}" in r.stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--gpu", "X100"], "not a GPU stepmem knows"),
        (["--gpu", "0.5"], "a size in GiB"),
        (["--gpu", "4090"], "the card is RTX-4090"),
        (["--gpu", "5000"], "written with its unit (5000GiB)"),
        (["--gpu", "H200", "--margin", "70"], "--margin 70"),
        (["--gpu", "H200", "--memory-fraction", "1.5"], "--memory-fraction 1.5"),
        (["--gpu", "H200", "--memory-fraction", "0"], "--memory-fraction 0"),
        (["--memory-fraction", "0.5"], "needs --gpu"),
        (["--max-batch"], "needs --gpu"),
        (["--alloc-conf", "max_split_size_mb:10"], "torch requires more than 20"),
        (["--alloc-conf", "expandable_segments:yes"], "True or False"),
        (["--alloc-conf", "no_such_setting:1"], "torch does not know it"),
        (["--alloc-conf", "backend:cudaMallocAsync"], "only torch's own caching allocator"),
        (["--gpu", "H200", "--max-batch", "--max-seq-len"], "not allowed with"),
    ],
)
def test_bad_fit_input_is_one_line_and_exit_2(argv, says, record_fault):
    if torch.cuda.is_available() and "needs --gpu" in says:
        pytest.skip("this machine has a GPU: it is the default card")
    r = _cli("estimate", "--size", "tiny", *argv, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    record_fault(
        f"bad input: stepmem estimate {' '.join(argv)}", r.stderr.strip()[:160], exit_code=2
    )


def test_an_allocator_setting_from_the_environment_is_said_and_a_bad_one_refused():
    import os

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    r = _cli("estimate", "--size", "tiny", "--json", env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["allocator"].startswith("expandable segments")
    assert "PYTORCH_CUDA_ALLOC_CONF" in json.loads(r.stdout)["allocator"]
    env["PYTORCH_CUDA_ALLOC_CONF"] = "garbage_collection_threshold:2"
    r = _cli("estimate", "--size", "tiny", env=env, timeout=120)
    assert r.returncode == 2 and "PYTORCH_CUDA_ALLOC_CONF" in r.stderr, r.stderr


def test_a_calibration_file_is_read_as_data_and_a_bad_one_ignored(tmp_path):
    from collector.estimate.gpus import MEASURED, Calibration

    path = tmp_path / "cal.json"
    mine = Calibration("NVIDIA L4", 500 << 20, 400 << 20, "1", "2", "3", "mine")
    save_calibration(mine, path)
    cals = load_calibrations(path)
    assert cals == [mine]
    c = card("L4", cals)
    assert c.outside_torch == 500 << 20 and not c.assumed
    assert (
        card("A10", cals).assumed and card("A10", cals).outside_torch == MEASURED[0].outside_torch
    )
    path.write_text(
        '{"calibrations": [{"gpu": 3, "outside_torch": "x"}, {"gpu": "A", "outside_torch": -1}]}'
    )
    assert load_calibrations(path) == []  # entries that are not calibrations: left out
    path.write_text("[1, 2]")
    with pytest.raises(EstimateError, match="not a stepmem calibration file"):
        load_calibrations(path)


def test_estimates_written_before_the_allocator_model_still_load_and_reconcile():
    """A format-1 estimate from before (no steps, card or fit) reads with those empty, and
    report --estimate names the cache as not predicted by it."""
    old = ROOT / "benchmarks" / "results" / "estimate" / "h200-7b-adamw_8bit.estimate.json"
    est = load_estimate(old)
    assert est.steps == [] and est.fit is None and est.reserved_peak is None
    assert est.nvml_peak is None
    r = _cli(
        "report",
        str(ROOT / "benchmarks/results/fit/runs/h200-fit-7b-adamw_8bit"),
        "--estimate",
        str(old),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "not predicted: this estimate was made before" in r.stdout


def test_report_puts_reserved_and_nvml_predicted_beside_measured():
    r = _cli(
        "report",
        str(ROOT / "benchmarks/results/fit/runs/h200-fit-1b-fsdp2"),
        "--estimate",
        str(FIT / "predicted/gpu/h200-fit-1b-fsdp2.json"),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "step 2 reserved peak" in x)
    assert re.search(r"46\.\d\d\s+46\.99", line), line
    nvml = next(x for x in r.stdout.splitlines() if "NVML used, step 2" in x)
    assert re.search(r"4[67]\.\d\d\s+47\.79", nvml), nvml


def test_nvml_off_by_more_than_3_percent_is_explained(tmp_path):
    """An estimate whose reserved peak is a tenth short of the run's: the difference is
    named as torch's pool beyond the model (a second stream, kernels' workspaces)."""
    d = json.loads((FIT / "predicted/gpu/h200-fit-qwen2.json").read_text())
    for s in d["steps"]:
        s["reserved_peak"] = int(s["reserved_peak"] * 0.9)
    f = tmp_path / "short.json"
    f.write_text(json.dumps(d))
    r = _cli("report", str(FIT / "runs/h200-fit-qwen2"), "--estimate", str(f), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "NVML's peak is" in r.stdout and "more than modelled" in r.stdout, r.stdout


def test_a_bad_card_in_an_estimate_file_is_refused(tmp_path):
    d = json.loads((FIT / "predicted/gpu/h200-fit-gpt2.json").read_text())
    d["fit"]["margin"] = 7
    with pytest.raises(EstimateError, match="margin"):
        Estimate.from_dict(d)
    d["fit"]["margin"] = 0.0
    d["largest"] = {"axis": "rm -rf", "traced": []}
    with pytest.raises(EstimateError, match="axis"):
        Estimate.from_dict(d)


def test_an_estimate_of_another_model_is_named_first_and_no_kernel_is_blamed(tmp_path):
    """N3, F8: a tiny model's estimate against the 7B run says what was estimated before the
    table, blames no CPU kernel for the difference, keeps its columns apart and gives a ratio
    past ten times as one (``18×``, not ``+2e+01x``)."""
    out = tmp_path / "tiny.json"
    assert _cli("estimate", "--size", "tiny", "--out", str(out), timeout=300).returncode == 0
    r = _cli("report", str(FIT / "runs/h200-fit-7b-adamw_8bit"), "--estimate", str(out))
    assert r.returncode == 0, r.stderr
    tail = r.stdout[r.stdout.index("Predicted vs measured") :].splitlines()
    # F8: said before the table, not after it
    assert tail[1].startswith(" ⚠ This estimate is of tiny, adamw_torch"), tail[:3]
    assert "standing in for CUDA" not in r.stdout and "more than modelled" not in r.stdout
    row = next(x for x in tail if x.strip().startswith("parameters"))
    assert re.search(r"\+25\.10\s+\d+×$", row), row  # the difference and a readable ratio


def test_the_headline_names_step_1_when_its_peak_is_the_largest():
    """Item 6: when step 1 peaks above step 2 (a step-1 transient), the text says so before it
    names step 2's holder, and the estimate's largest peak is step 1's."""
    est = Estimate(
        spec={"size": "tiny", "optim": "adamw_torch", "batch": 1, "seq_len": 64,
              "grad_accum": 1, "checkpointing": False, "bf16": False},
        device="cpu", stand_in=True, parameters_count=1000,
        steady={"parameters": 4 << 20, "activations": 2 << 20},
        first={"parameters": 4 << 20, "activations": 9 << 20},
        at_end={"parameters": 4 << 20},
    )  # fmt: skip
    assert est.largest_step == 1 and est.largest_peak == 13 << 20
    assert "Step 1's peak (13.00 MiB) is the largest of the steps traced" in render(est)


def test_consumer_cards_are_known_and_a_size_with_its_unit_is_a_size():
    assert card("RTX-4090").name == "NVIDIA GeForce RTX 4090"
    assert card("rtx 3090").capacity == 24576 * (1 << 20)
    assert card("NVIDIA RTX A6000").name == "NVIDIA RTX A6000"
    assert card("600GiB").capacity == 600 * (1 << 30) and card("24").capacity == 24 << 30


def test_a_search_where_nothing_fits_says_so_in_one_line_with_one_unit(record_fault):
    """Exit 3 and one line (with its progress lines before it): 'it needs 0.04 GiB of the 0.00
    GiB torch may reserve', not '0.04 GiB GiB of 0.00 GiB'."""
    r = _cli("estimate", "--size", "tiny", "--gpu", "1", "--max-batch", timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    said = [x for x in r.stderr.splitlines() if not x.startswith("… ")]
    assert len(said) == 1 and "not even batch 1 fits" in said[0], r.stderr
    assert "GiB GiB" not in r.stderr and "torch may reserve" in said[0]
    record_fault("stepmem estimate --size tiny --gpu 1 --max-batch (nothing fits)", said[0][:160])
