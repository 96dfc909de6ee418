"""``stepmem estimate --plan`` (:mod:`collector.estimate.plans`): the knobs' rules (micro-batches
keeping the global batch, what a fitting plan makes pointless, the flags a plan sets), every
plan's command parsed again to the request that was traced, the ranking (the same training
first), the checks before anything runs, and searches traced end to end on the CPU: the first
plan, run as printed, fits; a step nothing fixes is exit 3."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from collector.cli.subcommands import build_parser
from collector.estimate.allocator_config import AllocatorConfig
from collector.estimate.plans import knobs
from collector.estimate.plans.command import argv, shell
from collector.estimate.plans.search import fits
from collector.estimate.request import EstimateFlags, plan_estimate
from collector.estimate.run import run_estimate
from collector.estimate.spec import Spec, read_config
from collector.model.errors import EstimateError
from collector.model.plans import Knob
from collector.model.prediction import load_estimate
from tests.cli import stepmem

ROOT = Path(__file__).resolve().parent.parent
# the tiny model at 8 × 256 without checkpointing: 70 MiB reserved; 4 × 2 64 MiB, 2 × 4 42 MiB
TIGHT = [
    "--size", "tiny", "--seq-len", "256", "--batch", "8", "--grad-accum", "1",
    "--no-checkpointing", "--gpu", "8", "--memory-fraction", "0.0068", "--margin", "0",
]  # fmt: skip


def _flags(args: list[str]) -> EstimateFlags:
    return EstimateFlags.of(build_parser().parse_args(["estimate", *args]))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return stepmem("estimate", *args, timeout=600)


def test_smaller_micro_batches_keep_the_global_batch():
    assert knobs.micro_batches(Spec(batch=8, grad_accum=2)) == [(4, 4), (2, 8), (1, 16)]
    assert knobs.micro_batches(Spec(batch=6, grad_accum=1)) == [(3, 2), (1, 6)]
    assert knobs.micro_batches(Spec(batch=1, grad_accum=4)) == []
    for b, g in knobs.micro_batches(Spec(batch=12, grad_accum=3)):
        assert b * g == 36 and b < 12


def test_a_plan_that_changes_more_than_a_fitting_one_is_pointless():
    micro4 = knobs.turn((Knob.MICRO_BATCH, (4, 4)))
    assert knobs.dominated(knobs.turn((Knob.MICRO_BATCH, (2, 8))), [micro4])
    assert not knobs.dominated(knobs.turn((Knob.MICRO_BATCH, (8, 2))), [micro4])
    both = knobs.turn((Knob.CHECKPOINTING, True), (Knob.MICRO_BATCH, (4, 4)))
    assert knobs.dominated(both, [micro4])
    assert not knobs.dominated(knobs.turn((Knob.CHECKPOINTING, True)), [micro4])
    lora = knobs.turn((Knob.LORA, (16, None)))
    assert knobs.dominated(knobs.turn((Knob.QLORA, (16, None))), [lora])  # QLoRA is LoRA and more
    assert not knobs.dominated(lora, [knobs.turn((Knob.QLORA, (16, None)))])
    eight = knobs.turn((Knob.OPTIMIZER_8BIT, "adamw_8bit"))
    assert knobs.dominated(knobs.turn((Knob.PAGED_8BIT, "paged_adamw_8bit")), [eight])


def test_expandable_segments_join_the_users_settings():
    assert knobs.with_expandable("") == "expandable_segments:True"
    assert (
        knobs.with_expandable("max_split_size_mb:256,expandable_segments:False")
        == "max_split_size_mb:256,expandable_segments:True"
    )
    conf = AllocatorConfig.parse(knobs.with_expandable("max_split_size_mb:256"))
    assert conf.expandable_segments and conf.max_split_size == 256 << 20


def test_the_walk_keeps_what_the_user_keeps_and_tries_the_same_training_first():
    spec = Spec(batch=8, grad_accum=1, checkpointing=False)
    turns, said = knobs.walk(spec, frozenset())
    same = [all(k.same for k, _ in t) for t in turns]
    assert same == sorted(same, reverse=True)  # every same-training turn before a change
    assert any(Knob.CHECKPOINTING in dict(t) for t in turns)
    kept, said = knobs.walk(spec, frozenset({Knob.OPTIMIZER_8BIT, Knob.PAGED_8BIT, Knob.LORA}))
    used = {k for t in kept for k, _ in t}
    assert not used & {Knob.OPTIMIZER_8BIT, Knob.PAGED_8BIT, Knob.LORA}
    assert Knob.QLORA in used and any("kept as asked" in w for w in said)
    assert any(Knob.FSDP2 in dict(t) for t in turns)  # the HF Trainer's step under FSDP2
    assert not any(
        Knob.FSDP2 in dict(t) for t in knobs.walk(replace(spec, lora_r=8), frozenset())[0]
    )


def test_lora_plans_adapt_what_the_model_has():
    """A Llama-style model: every projection (stepmem's default); GPT-2, without those names:
    peft's own default for its type, and the plan's command names it."""
    llama, _ = knobs.walk(Spec(batch=2, grad_accum=1), frozenset())
    assert {dict(t)[Knob.LORA] for t in llama if Knob.LORA in dict(t)} == {(16, None)}
    gpt2 = Spec(size=None, config=read_config(ROOT / "benchmarks/configs/gpt2-medium.json"))
    turns, _ = knobs.walk(gpt2, frozenset())
    lora = next(t for t in turns if Knob.LORA in dict(t))
    assert dict(lora)[Knob.LORA] == (16, "c_attn")
    flags = _flags(["--config", "benchmarks/configs/gpt2-medium.json", "--gpu", "8", "--plan"])
    assert "--lora-targets c_attn" in " ".join(argv(knobs.flags_of(flags, lora, "")))


def test_fsdp2_plans_for_the_distributed_workload():
    spec = Spec.for_machine(False, "distributed", world_size=2)
    turns, _ = knobs.walk(spec, frozenset())
    assert [dict(t)[Knob.FSDP2] for t in turns if Knob.FSDP2 in dict(t)] == [4, 8, 16]


@pytest.mark.parametrize(
    "t",
    [
        ((Knob.MICRO_BATCH, (2, 4)),),
        ((Knob.ALLOCATOR, True), (Knob.CHECKPOINTING, True)),
        ((Knob.QLORA, (16, None)),),
        ((Knob.OPTIMIZER_8BIT, "adamw_8bit"), (Knob.SEQ_LEN, 128)),
    ],
)
def test_a_plans_command_parses_back_to_the_request_traced(t):
    """The command printed is the flags planned: parsed by the real parser, it plans the same
    spec and allocator settings, and a shell reads it back word for word."""
    flags = _flags([*TIGHT, "--plan", "--alloc-conf", "max_split_size_mb:64"])
    planned = knobs.flags_of(flags, knobs.turn(*t), "max_split_size_mb:64")
    cmd = argv(planned)
    again = _flags(list(cmd))
    assert again == planned
    assert shlex.split(shell(cmd))[2:] == list(cmd)
    a, b = plan_estimate(planned, cuda=False), plan_estimate(again, cuda=False)
    assert (a.spec, a.allocator, a.target) == (b.spec, b.allocator, b.target)
    assert "--plan" not in cmd


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--gpu", "8"], None),  # the control: planned
        ([], "--plan needs --gpu"),
        (["--gpu", "8", "--max-batch"], "--plan searches its own micro-batch"),
        (["--gpu", "8", "--keep", "nope"], "--keep nope: one of allocator"),
    ],
)
def test_plan_flags_are_checked_before_anything_runs(extra, says):
    flags = _flags(["--size", "tiny", "--plan", *extra])
    if says is None:
        assert plan_estimate(flags, cuda=False).plan == frozenset()
        return
    with pytest.raises(EstimateError, match=says):
        plan_estimate(flags, cuda=False)


def test_keep_without_plan_and_plan_with_a_script_are_refused(tmp_path):
    with pytest.raises(EstimateError, match="--keep is for --plan"):
        plan_estimate(_flags(["--size", "tiny", "--keep", "optim"]), cuda=False)
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(EstimateError, match="--plan is for --size, --config and --like"):
        plan_estimate(_flags(["--script", str(script), "--gpu", "8", "--plan"]), cuda=False)
    kept = plan_estimate(
        _flags(["--size", "tiny", "--gpu", "8", "--plan", "--keep", "optim"]), False
    )
    assert kept.plan == {Knob.OPTIMIZER_8BIT, Knob.PAGED_8BIT}


@pytest.fixture(scope="module")
def searched():
    """A tiny step that does not fit, searched: its request and outcome."""
    req = plan_estimate(_flags([*TIGHT, "--plan"]), cuda=False)
    return req, run_estimate(req)


def test_a_search_finds_plans_that_fit_the_same_training_first(searched):
    _req, out = searched
    r = out.plans
    assert r is not None and not r.fits and not fits(out.estimate)
    assert r.plans and all(p.fits and p.headroom >= 0 and p.need <= r.usable for p in r.plans)
    assert r.plans[0].same_training
    order = [p.same_training for p in r.plans]
    assert order == sorted(order, reverse=True)
    assert all(not p.fits and p.need > r.usable for p in r.tried)
    assert r.traces >= 2 and r.reheld >= 1  # expandable segments held again, not traced
    assert r.step_flops == out.estimate.step_flops and r.step_flops > 0


def test_every_plan_checked_alone_gives_the_figures_the_search_printed(searched):
    """Each plan's command planned and estimated on its own: the same need, the same verdict
    (the re-held ones included: a re-hold is the trace's figures under other settings)."""
    _req, out = searched
    for p in [*out.plans.plans, *out.plans.tried[:2]]:
        alone = run_estimate(plan_estimate(_flags(list(p.command)), cuda=False)).estimate
        assert (alone.fit.need, fits(alone)) == (p.need, p.fits), p.changes
        assert alone.step_flops == p.step_flops


def test_flops_say_what_a_plan_costs(searched):
    """Smaller micro-batches are the same work; checkpointing recomputes the forward."""
    req, out = searched
    base = out.plans.step_flops
    spec = req.spec
    micro = run_estimate(
        replace(req, subject=replace(spec, batch=2, grad_accum=4), plan=None)
    ).estimate
    ckpt = run_estimate(replace(req, subject=replace(spec, checkpointing=True), plan=None)).estimate
    assert micro.step_flops == base
    assert 1.1 < ckpt.step_flops / base < 1.5


def test_the_cli_prints_plans_as_commands_and_the_first_fits_as_printed(tmp_path):
    out = tmp_path / "est.json"
    p = _cli(*TIGHT, "--plan", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "Plans for 8 GiB" in p.stdout and "… plan " in p.stderr
    doc = json.loads(out.read_text())
    first = doc["plans"]["plans"][0]
    assert f"   {shell(tuple(first['command']))}" in p.stdout.splitlines()
    assert load_estimate(out).step_flops == doc["step_flops"]  # the file still reads
    check = _cli(*first["command"])
    assert check.returncode == 0, check.stderr
    assert any(line.startswith("Fits: ") for line in check.stdout.splitlines())


def test_without_plan_a_step_that_does_not_fit_says_how_to_ask():
    p = _cli(*TIGHT)
    assert p.returncode == 0
    assert "add --plan for the changes that do" in p.stderr


def test_a_step_nothing_makes_fit_is_exit_3():
    tight = [a if a != "0.0068" else "0.001" for a in TIGHT]  # 7.6 MiB: not even the weights
    p = _cli(*tight, "--plan", "--keep", "seq_len,lora,qlora")
    assert p.returncode == 3, p.stderr
    assert "no plan found fits" in p.stderr and "Traced, and do not fit:" in p.stdout
    # a group whose strongest plan does not fit is not walked: the step as asked, and one
    # trace for each group (the same training, 8-bit AdamW, paged 8-bit AdamW)
    traced = int(re.search(r"(\d+) step\(s\) traced", p.stdout).group(1))
    assert traced == 4, p.stdout
    assert p.stderr.count("not even its strongest plan fits") == 3, p.stderr


def test_a_step_that_fits_needs_no_plan():
    p = _cli("--size", "tiny", "--gpu", "8", "--plan")
    assert p.returncode == 0, p.stderr
    assert "The step fits as asked" in p.stdout


def _run(ooms: int, peak_gib: float, workload: str = "finetune"):
    from collector.analysis.runs import Run
    from tests.records import GIB, step_record_data, typed

    d = step_record_data()
    d["torch_end"]["num_ooms"] = ooms
    d["nvml_peak_bytes"] = int(peak_gib * GIB)
    sampler = {"gpu_uuid": "GPU-abc", "node_id": "n", "index": 0, "total_bytes": 140 * GIB}
    meta = {
        "samplers": [{**sampler, "name": "NVIDIA H200"}],
        "workload_summary": {"workload": workload, "size": "7b"},
    }
    return Run("r", meta, typed([d]), source="runs/r")


def test_a_run_that_ran_out_or_sat_at_the_edge_offers_the_plan_search():
    from collector.analysis.make_it_fit import offer

    out = offer(_run(ooms=1, peak_gib=90))
    assert "It ran out of memory (1 time torch counted)" in out[0]
    assert out[1].split() == [
        "stepmem", "estimate", "--like", "runs/r", "--gpu", "'NVIDIA", "H200'", "--plan",
    ]  # fmt: skip
    assert shlex.split(out[1])[5] == "NVIDIA H200"
    assert "sat within 2% of the card's 140.00 GiB" in offer(_run(ooms=0, peak_gib=138))[0]
    assert offer(_run(ooms=0, peak_gib=90)) == []  # room left: nothing offered
    assert offer(_run(ooms=1, peak_gib=90, workload="spiky")) == []  # --like reads finetune


def test_a_plan_of_a_measured_run_keeps_its_model_and_sets_the_knobs(tmp_path):
    """``--like RUN --plan``: the run's model, optimizer and batch, and a plan's --batch and
    --grad-accum win over the run's (what the flags name wins)."""
    summary = {"workload": "finetune", "size": "tiny", "optim": "adamw_torch", "seq_len": 256}
    summary.update(batch=8, grad_accum=1)
    flags = _flags(["--like", str(tmp_path / "run"), "--gpu", "8", "--plan"])
    req = plan_estimate(flags, cuda=False, like=summary)
    assert (req.spec.size, req.spec.batch, req.spec.grad_accum) == ("tiny", 8, 1)
    t = knobs.turn((Knob.MICRO_BATCH, (2, 4)))
    planned = plan_estimate(knobs.flags_of(flags, t, ""), cuda=False, like=summary)
    assert (planned.spec.size, planned.spec.batch, planned.spec.grad_accum) == ("tiny", 2, 4)
    assert ["--like", str(tmp_path / "run")] == list(argv(knobs.flags_of(flags, t, ""))[:2])
