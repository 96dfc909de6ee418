"""`stepmem estimate --script`: users' own scripts, unchanged, estimated on fake tensors (CPU).

The scripts are the H200 validation's own (``benchmarks/scripts``) at a tiny size: the README's
example, a plain ``adamw_torch`` loop, an HF Trainer, a Lightning ``fit``, QLoRA (4-bit base, peft
adapters, 8-bit and paged 8-bit AdamW). Each is held to the same script traced on real CPU
tensors under torch's memory tracker: parameters, gradients and optimizer state equal to the
byte."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from collector.estimate.request import EstimateFlags, plan_estimate
from collector.estimate.script import estimate_script as _estimate_script
from collector.model.errors import EstimateError

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "benchmarks" / "scripts"
HELD = ("parameters", "gradients", "optimizer_state")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Llama as a local model folder (config.json and safetensors of zeros)."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run(
        [sys.executable, str(SCRIPTS / "make_model.py"), "tiny", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def estimate_script(path: Path, args: list[str], real: bool = False):
    """The script estimated as ``stepmem estimate --script PATH -- ARGS`` plans it."""
    import torch

    flags = EstimateFlags(script=path, script_args=tuple(args))
    return _estimate_script(plan_estimate(flags, torch.cuda.is_available(), real=real))


def _cli(*argv: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "collector.cli", "estimate", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("readme_train", []),
        ("plain_adamw", []),
        ("hf_trainer", []),
        ("lightning_fit", []),
        ("qlora", ["--optim", "adamw_8bit"]),
        ("qlora", ["--optim", "adamw_torch", "--rank", "8"]),
    ],
)
def test_a_script_on_fake_tensors_equals_it_on_real_tensors(model_dir, script, args):
    """Parameters (a 4-bit base's packed weights and quantisation state included), gradients and
    optimizer state, for both steps' peaks and what stays: the fake trace equals the real one."""
    path = SCRIPTS / f"{script}.py"
    fake, error = estimate_script(path, [str(model_dir), *args])
    assert not error and fake is not None, error
    real, error = estimate_script(path, [str(model_dir), *args], real=True)
    assert not error and real is not None, error
    for kind in HELD:
        assert fake.first.get(kind) == real.first.get(kind), kind
        assert fake.steady.get(kind) == real.steady.get(kind), kind
        assert fake.at_end.get(kind) == real.at_end.get(kind), kind
    assert fake.at_end["parameters"] > 0 and fake.at_end["optimizer_state"] > 0
    assert fake.stand_in and fake.spec["script"] == path.name and fake.steps
    assert fake.parameters_count == real.parameters_count > 0


def test_qlora_lays_out_bitsandbytes_4bit_weights_as_bitsandbytes_does(model_dir):
    """The tiny model's seven projections a layer in NF4 with double quantisation: half a byte a
    weight, one uint8 absmax per 64, a float32 absmax per 256 of those and the maps — the
    parameters figure is those, the float32 embedding and head (kbit preparation casts them), the
    norms and the adapters."""
    from collector.estimate.spec import SHAPES

    est, error = estimate_script(SCRIPTS / "qlora.py", [str(model_dir), "--optim", "adamw_torch"])
    assert not error, error
    s = SHAPES["tiny"]
    h, i, v, layers = (s[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                      "num_hidden_layers"))  # fmt: skip
    weights = layers * (4 * h * h + 3 * h * i)
    r = 16  # the script's default rank: A (r × in) and B (out × r), float32, for each projection
    adapters = 4 * layers * r * (4 * (h + h) + 2 * (h + i) + (i + h))
    norms = 4 * h * (2 * layers + 1)
    embed_head = 2 * 4 * v * h
    packed = weights // 2
    absmax = weights // 64
    known = packed + absmax + adapters + norms + embed_head
    # what is left is double quantisation's own: per quantised weight, a float32 absmax per 256
    # absmax blocks, the 256-entry float32 dynamic map, the offset and the 16-entry NF4 code
    left = est.at_end["parameters"] - known
    assert 0 < left < layers * 7 * (4 * 4 + 256 * 4 + 4 + 16 * 4), left
    assert est.steady["optimizer_state"] == 2 * adapters  # AdamW: two float32 moments


def test_paged_state_is_managed_memory_outside_torchs_pool(tmp_path):
    """A paged 8-bit AdamW: state of a tensor of 10^5 elements or more is predicted as managed
    memory (NVML counts it, torch never does); the rest stays on the device — and together they
    are what the same optimizer holds on real tensors (where the CPU keeps it all)."""
    script = tmp_path / "paged.py"
    script.write_text(
        "import torch, bitsandbytes as bnb\n"
        "from collector.probe.core import StepProbe\n"
        "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "m = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(256, 16)).to(dev)\n"
        "opt = bnb.optim.PagedAdamW8bit(m.parameters(), lr=1e-3)\n"
        "probe = StepProbe().watch(m, opt)\n"
        "for i in range(3):\n"
        "    with probe.step(i):\n"
        "        m(torch.randn(8, 512, device=dev)).sum().backward()\n"
        "        opt.step()\n"
        "        opt.zero_grad()\n"
    )
    fake, error = estimate_script(script, [])
    assert not error, error
    real, error = estimate_script(script, [], real=True)
    assert not error, error
    assert fake.optimizer_state_managed == 2 * 512 * 256  # uint8 state1 and state2
    state = "optimizer_state"
    assert fake.at_end[state] + fake.optimizer_state_managed == real.at_end[state]
    assert real.optimizer_state_managed == 0


def test_a_grad_scaler_steps_as_in_a_healthy_run(tmp_path):
    """fp16 with ``GradScaler``: its step reads ``found_inf`` (made zero, written only by the
    check for infinities) and steps the optimizer only when that is zero. Answered as a healthy
    run answers it (zero), not with a placeholder (1.0 skipped every step: no optimizer state):
    the fake trace holds the optimizer's state, as the same script on real tensors does."""
    script = tmp_path / "scaler.py"
    script.write_text(
        "import torch\n"
        "from collector.probe.core import StepProbe\n"
        "m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 16)).cuda()\n"
        "opt = torch.optim.AdamW(m.parameters())\n"
        "scaler = torch.amp.GradScaler('cuda')\n"
        "probe = StepProbe().watch(m, opt)\n"
        "for i in range(3):\n"
        "    with probe.step(i):\n"
        "        with torch.autocast('cuda', dtype=torch.float16):\n"
        "            loss = m(torch.randn(8, 256, device='cuda')).float().pow(2).mean()\n"
        "        scaler.scale(loss).backward()\n"
        "        scaler.step(opt)\n"
        "        scaler.update()\n"
        "        opt.zero_grad()\n"
    )
    fake, error = estimate_script(script, [])
    assert not error and fake is not None, error
    real, error = estimate_script(script, [], real=True)
    assert not error and real is not None, error
    adam = 2 * 4 * (256 * 256 + 256 + 256 * 16 + 16)  # exp_avg and exp_avg_sq, float32
    assert fake.at_end["optimizer_state"] == real.at_end["optimizer_state"] == adam
    assert fake.spec["optim"] == "AdamW"
    for kind in HELD:
        assert fake.steady.get(kind) == real.steady.get(kind), kind


def test_a_script_that_asks_torch_accelerator_takes_its_gpu_branch(tmp_path):
    """pytorch/examples' scripts pick their device with ``torch.accelerator``: under the
    estimate it answers as the GPU would (CUDA, one device), also on the CPU stand-in, and its
    memory counters are the estimate's, as ``torch.cuda``'s are."""
    script = tmp_path / "accel.py"
    script.write_text(
        "import torch\n"
        "from collector.probe.core import StepProbe\n"
        "use = torch.accelerator.is_available()\n"
        "device = torch.accelerator.current_accelerator() if use else torch.device('cpu')\n"
        "assert device.type == 'cuda' and torch.accelerator.device_count() == 1, device\n"
        "m = torch.nn.Linear(512, 512).to(device)\n"
        "opt = torch.optim.AdamW(m.parameters())  # it asks the accelerator's stream\n"
        "probe = StepProbe().watch(m, opt)\n"
        "for i in range(3):\n"
        "    with probe.step(i):\n"
        "        m(torch.randn(16, 512, device=device)).sum().backward()\n"
        "        opt.step()\n"
        "        torch.accelerator.synchronize()\n"
        "    if i == 1 and hasattr(torch.accelerator, 'max_memory_allocated'):\n"
        "        a = torch.accelerator.max_memory_allocated()\n"
        "        c = torch.cuda.max_memory_allocated()\n"
        "        assert a == c > 512 * 512 * 4, (a, c)\n"
    )
    est, error = estimate_script(script, [])
    assert not error and est is not None, error
    assert est.at_end["parameters"] == (512 * 512 + 512) * 4
    assert est.steady["gradients"] == (512 * 512 + 512) * 4


def test_every_torch_cuda_call_a_script_makes_answers(tmp_path):
    """Each of the trial's ``torch.cuda`` calls answers under the estimate (without a GPU, from
    the stand-in): torch's own ``memory_summary`` prints the estimate's figures, the snapshot's
    segments hold what ``memory_allocated`` says, a dumped snapshot with its recorded history is
    read by ``stepmem report``'s history reader, and ``set_per_process_memory_fraction`` is the
    share the step is held against."""
    from collector.analysis.history import load_snapshot

    script = SCRIPTS / "cuda_calls.py"
    dump = tmp_path / "snap.pickle"
    r = _cli("--script", str(script), "--gpu", "H100-80GB", "--json", "--", str(dump))
    assert r.returncode == 0, r.stderr[-3000:]
    est = json.loads(r.stdout)
    assert not est["stopped_at"] and len(est["steps"]) == 2, est["notes"]
    assert "PyTorch CUDA memory summary" in r.stderr
    assert est["fit"]["fraction"] == 0.5
    assert any("set_per_process_memory_fraction(0.5)" in n for n in est["notes"])
    snap = load_snapshot(dump)
    trace = snap["device_traces"][0]
    assert {e["action"] for e in trace} >= {"alloc", "free_completed"}
    assert sum(s["allocated_size"] for s in snap["segments"]) > 0


@pytest.mark.parametrize(
    ("call", "said"),
    [
        ("torch.cuda.MemPool()", "CPU stand-in for CUDA: torch.cuda.MemPool ("),
        ("torch.cuda.get_stream_from_external(0)", "torch.cuda.get_stream_from_external ("),
        (
            "torch.cuda.memory._set_allocator_settings('expandable_segments:True')",
            "the estimate's for the whole script: give them as --alloc-conf",
        ),
    ],
)
def test_a_torch_cuda_call_the_estimate_lacks_is_named_as_its_gap(tmp_path, call, said):
    """A ``torch.cuda`` call the estimate does not answer is said as the estimate's gap, naming
    the call, not as the script's error."""
    import torch

    if torch.cuda.is_available() and "settings" not in call:
        pytest.skip("a GPU answers torch.cuda itself")
    script = tmp_path / "gap.py"
    script.write_text(f"import torch\n{call}\n")
    r = _cli("--script", str(script))
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "gap.py:2: not modelled by the estimate" in line and said in line, line
    assert "the script raised" not in line


def test_a_scripts_largest_batch_is_searched_through_its_own_option(tmp_path):
    """``--max-batch --batch-arg batch-size``: the script traced at each size the search names,
    through its own ``--batch-size``; the answer is traced and fits, and the script estimated
    on its own at one more does not fit."""
    script = SCRIPTS / "searched.py"
    r = _cli(
        "--script", str(script), "--gpu", "4", "--max-batch", "--batch-arg", "batch-size",
        "--json", "--", "--batch-size", "100",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    est = json.loads(r.stdout)
    best = est["largest"]["largest"]
    traced = {t["value"]: t["fits"] for t in est["largest"]["traced"]}
    assert best > 1 and traced[best] and est["fit"]["fits"]
    assert not traced.get(best + 1, True) and est["largest"]["converged"]
    assert f"--batch-size {best}" in " ".join(est["spec"]["args"])
    assert any(f"the largest that fits is --batch-size {best}" in n for n in est["notes"])
    alone = _cli("--script", str(script), "--gpu", "4", "--json", "--", f"--batch-size={best + 1}")
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert not json.loads(alone.stdout)["fit"]["fits"]


def test_a_script_printing_torchs_counters_prints_the_estimates_figures(model_dir):
    """``torch.cuda.memory_allocated``/``max_memory_allocated``/``memory_reserved`` in the script
    are answered from the allocator model: what plain_adamw.py prints after its first step is
    the estimate's step-1 end figure."""
    r = _cli("--script", str(SCRIPTS / "plain_adamw.py"), "--json", "--", str(model_dir))
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)
    printed = re.search(r"step 0: loss [\d.]+ allocated ([\d.]+) GiB", r.stderr)
    assert printed, r.stderr
    assert float(printed.group(1)) == round(est["steps"][0]["allocated_end"] / 2**30, 2)
    assert est["steps"][0]["allocated_end"] > est["at_end"]["parameters"]


def test_the_cli_prints_the_estimate_and_writes_it(model_dir, tmp_path):
    out = tmp_path / "est.json"
    r = _cli("--script", str(SCRIPTS / "hf_trainer.py"), "--out", str(out), "--", str(model_dir))
    assert r.returncode == 0, r.stderr
    assert "script hf_trainer.py" in r.stdout and "What the GPU will hold" in r.stdout
    saved = json.loads(out.read_text())
    assert saved["spec"]["workload"] == "script" and saved["spec"]["optim"] == "AdamW"


def test_a_line_fake_tensors_cannot_run_is_named(tmp_path, record_fault):
    """A data-dependent shape in the script's step: its file and line, the steps before it kept,
    exit 1."""
    script = tmp_path / "picky.py"
    script.write_text(
        "import torch\n"
        "from collector.probe.core import StepProbe\n"
        "m = torch.nn.Linear(8, 8).cuda()\n"
        "opt = torch.optim.AdamW(m.parameters())\n"
        "probe = StepProbe().watch(m, opt)\n"
        "for i in range(3):\n"
        "    with probe.step(i):\n"
        "        x = m(torch.randn(4, 8, device='cuda'))\n"
        "        if i == 1:\n"
        "            x = x[torch.nonzero(x > 0)[:, 0]]  # how many rows: only the data knows\n"
        "        x.sum().backward()\n"
        "        opt.step()\n"
    )
    r = _cli("--script", str(script), cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("stepmem estimate: picky.py:10: cannot run on fake tensors"), last
    assert "Estimate:" in r.stdout and "Stopped at picky.py:10" in r.stdout
    record_fault(
        "bad input: a script fake tensors cannot run (torch.nonzero in its second step)",
        last[:160],
        exit_code=1,
    )


DEVICE_INDICES = (
    "import numpy as np, torch\n"
    "from collector.probe.core import StepProbe\n"
    "data = np.arange(50_000, dtype=np.uint16) % 256  # a token memmap, as nanoGPT's\n"
    "emb, head = torch.nn.Embedding(256, 64).cuda(), torch.nn.Linear(64, 256).cuda()\n"
    "opt = torch.optim.AdamW([*emb.parameters(), *head.parameters()])\n"
    "probe = StepProbe().watch(emb, opt)\n"
    "for step in range(3):\n"
    "    with probe.step(step):\n"
    "        ix = torch.randint(len(data) - 128, (12,), device='cuda')  # drawn on the GPU\n"
    "        x = torch.stack([torch.from_numpy(data[i:i + 128].astype(np.int64)) for i in ix])\n"
    "        x = x.to('cuda')\n"
    "        loss = torch.nn.functional.cross_entropy(head(emb(x)).flatten(0, 1), x.flatten())\n"
    "        loss.backward()\n"
    "        opt.step()\n"
    "        opt.zero_grad()\n"
    "        print(f'step {step} loss {loss.item():.4f}')\n"
)
A_BRANCH = (
    "import torch\n"
    "from collector.probe.core import StepProbe\n"
    "m = torch.nn.Linear(64, 64).cuda()\n"
    "opt = torch.optim.SGD(m.parameters())\n"
    "probe = StepProbe().watch(m, opt)\n"
    "for step in range(3):\n"
    "    with probe.step(step):\n"
    "        x = m(torch.randn(8, 64, device='cuda'))\n"
    "        if (x.sum() > 0).item():  # the data picks the branch\n"
    "            x = x @ torch.randn(64, 1 << 16, device='cuda')\n"
    "        x.sum().backward()\n"
    "        opt.step()\n"
)


@pytest.mark.parametrize(
    ("name", "body", "line"),
    [("device_indices", DEVICE_INDICES, 10), ("a_branch", A_BRANCH, 9)],
)
def test_a_placeholder_that_decides_the_figures_is_named_and_exit_4(
    tmp_path, name, body, line, record_fault
):
    """nanoGPT's ``get_batch`` with its indices drawn on the GPU: each index read from a fake
    tensor is a placeholder, and both ends of the slice read the same one (a batch of 12 × 0
    tokens: activations 0; drawn on the host, as nanoGPT draws them, the indices are real:
    tests/test_estimate_host.py). A branch on a device value does the same. The second
    trace with other placeholders gives other figures: the line that read the value is named
    first, there is no verdict on fitting, and the exit status is 4."""
    script = tmp_path / f"{name}.py"
    script.write_text(body)
    r = _cli("--script", str(script), "--gpu", "24", cwd=tmp_path)
    assert r.returncode == 4, r.stdout + r.stderr
    head = r.stdout.splitlines()
    assert head[1].startswith(
        f"⚠ Not trustworthy: a value read from a fake tensor at {name}.py:{line} "
    )
    assert "Fits:" not in r.stdout and "Does not fit" not in r.stdout
    assert "Cannot say whether it fits on 24 GiB" in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"stepmem estimate: not trustworthy: a value read from a fake tensor at {name}.py:{line}"
    )
    what = name.replace("_", " ")
    record_fault(
        f"wrong figure: a placeholder decides the figures ({what})", last[:160], exit_code=4
    )


def test_reads_that_decide_nothing_are_traced_twice_and_trusted(model_dir):
    """The plain loop reads its loss (``loss.item()``): traced again with other placeholders it
    allocates the same, so its estimate carries no doubt — and says it was checked."""
    est, error = estimate_script(SCRIPTS / "plain_adamw.py", [str(model_dir)])
    assert not error and est is not None and est.undecided == ""
    assert est.notes[-1] == (
        "traced again with other placeholders: the same figures, no placeholder decided them"
    )


@pytest.mark.parametrize(
    ("body", "argv", "says", "code"),
    [
        ("print('no probe here')\n", [], "ran to its end without a probe step", 2),
        ("raise ValueError('bad data path')\n", [], "picky.py:1: the script raised: ValueError", 2),
        ("import sys\nsys.exit(3)\n", [], "the script exited with status 3", 2),
        ("import time\nwhile True:\n    time.sleep(0.05)\n", ["--time-limit", "3"], "in 3 s", 2),
        ("", ["--optim", "adamw_torch"], "drop --optim", 2),
    ],
)
def test_a_script_that_cannot_be_estimated_says_why_in_one_line(
    tmp_path, body, argv, says, code, record_fault
):
    script = tmp_path / "picky.py"
    script.write_text(body)
    r = _cli("--script", str(script), *argv, cwd=tmp_path)
    assert r.returncode == code, r.stdout + r.stderr
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("stepmem estimate")]
    assert len(lines) == 1 and says in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    record_fault(f"bad input: stepmem estimate --script ({says})", lines[0][:160], exit_code=code)


def test_script_arguments_without_a_script_are_refused():
    r = _cli("--size", "tiny", "--", "--lr", "1")
    assert r.returncode == 2 and "are for --script" in r.stderr, r.stderr


def test_a_missing_script_is_an_estimate_error(tmp_path):
    with pytest.raises(EstimateError, match="no such file"):
        estimate_script(tmp_path / "absent.py", [])


def test_the_lora_flags_give_what_the_qlora_script_gives(model_dir):
    """``--size tiny --lora-r 16 --load-in-4bit --optim adamw_8bit`` and the QLoRA script on the
    same shape, as saved: the same parameters (packed weights, quantisation state, float32
    embedding, head, norms, adapters) and the same optimizer state, to the byte."""
    from collector.estimate import Spec, estimate

    flags = estimate(
        Spec(size="tiny", seq_len=64, batch=2, lora_r=16, load_in_4bit=True, optim="adamw_8bit")
    )
    script, error = estimate_script(SCRIPTS / "qlora.py", [str(model_dir), "--optim", "adamw_8bit"])
    assert not error, error
    for kind in ("parameters", "optimizer_state"):
        assert flags.at_end[kind] == script.at_end[kind], kind
    assert flags.spec["lora_r"] == 16 and flags.spec["load_in_4bit"]
    # built as from_pretrained quantises: the GPU never holds the model in full precision, so
    # what torch reserves is the script's (the flags' path reserved 26.6 GiB for a 7B, the
    # script 7.6, when the base was built whole on the device and quantised there)
    assert flags.reserved_peak == script.reserved_peak, (flags.steps, script.steps)


def test_a_4bit_base_is_loaded_a_layer_at_a_time():
    """While the 4-bit base is built, the (fake) GPU holds less than the model would in full
    precision: each linear layer's bf16 weight is on it only while it is quantised."""
    from collector.estimate import Spec, estimate
    from collector.estimate.alloc_log import simulate
    from collector.estimate.allocator import AllocatorConfig
    from collector.model.kinds import Phase

    logs = []
    spec = Spec(size="tiny", seq_len=32, lora_r=8, load_in_4bit=True)
    estimate(spec, logs=logs)
    build = simulate(logs[0].events, AllocatorConfig()).over(str(Phase.BUILD))
    whole = estimate(Spec(size="tiny", seq_len=32)).parameters_count  # the base, unquantised
    # 423,424 B; building the base whole in float32 first held 658,944 (whole: 591,104)
    assert 0 < build.allocated_peak < 4 * whole


def test_lora_on_fake_tensors_equals_lora_on_real_tensors():
    """A 4-bit base with adapters traced by ``--config``'s path: every category of both steps,
    fake against real CPU tensors (bitsandbytes quantises on the CPU for real)."""
    from collector.estimate import Spec, estimate

    spec = Spec(size="tiny", seq_len=32, lora_r=8, load_in_4bit=True, checkpointing=False)
    fake, real = estimate(spec), estimate(spec, fake=False)
    for kind in HELD:
        assert fake.steady[kind] == real.steady[kind], kind
        assert fake.at_end.get(kind) == real.at_end.get(kind), kind


def test_the_qlora_estimate_equals_the_probes_ledger_of_the_script_run_for_real(
    model_dir, tmp_path
):
    """The QLoRA script run for real on the CPU, its probe writing events (no sampler): the
    ledger's parameters (4-bit weights with their quantisation state, as the ledger counts them)
    and optimizer state at each step end are the estimate's resident figures, to the byte."""
    import os

    events = tmp_path / "events.jsonl"
    args = [str(model_dir), "--optim", "adamw_8bit"]
    env = {**os.environ, "STEPMEM_EVENTS": str(events), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "qlora.py"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    ends = [json.loads(x) for x in events.read_text().splitlines()]
    ledgers = [e["ledger"] for e in ends if e.get("kind") == "end" and e.get("ledger")]
    assert len(ledgers) >= 2
    est, error = estimate_script(SCRIPTS / "qlora.py", args)
    assert not error, error
    for led in ledgers[1:]:
        assert led["parameters"] == est.at_end["parameters"]
        assert led["optimizer_state"] == est.at_end["optimizer_state"]


def _running(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != "Z":
            out.append(int(entry.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="Linux /proc")
@pytest.mark.parametrize(
    "how",
    [
        "double fork and setsid",  # a daemonising helper
        "Popen(start_new_session=True)",  # a tracker service, TensorBoard
        "the script kills its keeper",
    ],
)
def test_nothing_a_script_starts_outlives_the_estimate(tmp_path, how, record_fault):
    """Whatever the script starts — in a session of its own, or after killing its keeper — is
    ended when the estimate ends, and said."""
    marker = f"stepmem-left-{os.getpid()}-{len(how)}"
    start = {
        "double fork and setsid": (
            "import os\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            f"        os.execvp('bash', ['bash', '-c', 'sleep 600; : {marker}'])\n"
            "    os._exit(0)\n"
            "os.wait()\n"
        ),
        "Popen(start_new_session=True)": (
            "import subprocess\n"
            f"subprocess.Popen(['bash', '-c', 'sleep 600; : {marker}'], start_new_session=True)\n"
        ),
        "the script kills its keeper": (
            "import os, signal, subprocess\n"
            f"subprocess.Popen(['bash', '-c', 'sleep 600; : {marker}'])\n"
            "os.kill(os.getppid(), signal.SIGKILL)\n"
            "import time\n"
            "time.sleep(600)\n"
        ),
    }[how]
    script = tmp_path / "leaves.py"
    script.write_text(start)
    try:
        r = _cli("--script", str(script), "--time-limit", "120", cwd=tmp_path)
        assert r.returncode == 2, r.stdout + r.stderr  # no probe step: no estimate
        assert "the script left" in r.stderr, r.stderr
        assert _running(marker) == [], f"left running: {_running(marker)}"
    finally:
        for pid in _running(marker):
            os.kill(pid, 9)
    record_fault(
        f"a script under estimate --script that leaves a process ({how})",
        "ended when the estimate ends, and named: "
        + next(x for x in r.stderr.splitlines() if "the script left" in x)[:140],
        exit_code=r.returncode,
    )


def test_a_forged_result_nested_deep_is_one_line(tmp_path, record_fault):
    """A script that writes its own result file (200,000 lists deep) in the child's place: the
    result is untrusted data, read bounded and shallow — one line, not a crash."""
    script = tmp_path / "forge.py"
    script.write_text(
        "import json, os\n"
        "request = open('/proc/self/cmdline', 'rb').read().split(b'\\0')[-2].decode()\n"
        "req = json.loads(open(request).read())\n"
        "open(req['result'], 'w').write('{\"estimate\": ' + '[' * 200000 + ']' * 200000 + '}')\n"
        "os._exit(0)\n"
    )
    r = _cli("--script", str(script), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("stepmem estimate")]
    assert len(lines) == 1 and "nested" in lines[0] and "Traceback" not in r.stderr, r.stderr
    record_fault("bad input: a script that forges a deep result file", lines[0][:160], exit_code=2)


def test_torchs_warnings_are_shown_at_the_scripts_line_and_bitsandbytes_is_quiet(tmp_path):
    """``float(loss)`` warns in torch's C++; under the estimate it was shown at stepmem's
    ``cuda_api.py``, as if the estimate had erred. And a 4-bit estimate began with bitsandbytes'
    warning that its CPU kernels' hub is offline (the CPU that traces does not use them)."""
    script = tmp_path / "warns.py"
    script.write_text(
        "import torch\n"
        "from collector.probe import StepProbe\n"
        "m = torch.nn.Linear(8, 8).cuda()\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "probe = StepProbe().watch(m, opt)\n"
        "for step in range(2):\n"
        "    with probe.step(step):\n"
        "        loss = m(torch.randn(4, 8, device='cuda')).sum()\n"
        "        print(float(loss))\n"
        "        loss.backward(); opt.step(); opt.zero_grad()\n"
    )
    res = _cli("--script", str(script), "--gpu", "24")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"{script}:9: UserWarning: Converting a tensor" in res.stderr, res.stderr
    assert "collector/" not in res.stderr, res.stderr
    assert "Estimate: Linear (72 parameters), script warns.py" in res.stdout  # its model's class
    q = _cli("--size", "tiny", "--lora-r", "8", "--load-in-4bit", "--seq-len", "32")
    assert q.returncode == 0, q.stderr[-2000:]
    assert "bitsandbytes" not in q.stdout + q.stderr, q.stderr


@pytest.mark.parametrize(
    ("header", "said"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (b'{"__metadata__": [1, 2, 3]}', "__metadata__ is not an object"),
        (b'{"w": [1, 2]}', "dtype or shape unreadable"),
        (b'{"w": {"dtype": "F32", "shape": [NaN]}}', "not JSON"),
    ],
)
def test_a_hostile_safetensors_header_is_one_line_of_ours(tmp_path, header, said):
    """A header 100,000 deep was ``RecursionError … while decoding a JSON array``, a list of
    metadata ``TypeError: cannot convert dictionary update sequence``: raw text of Python's."""
    import struct

    from collector.estimate.script.weights import read_header

    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(EstimateError) as err:
        read_header(path)
    line = str(err.value)
    assert said in line and str(path) in line and "\n" not in line, line


def test_a_4bit_base_is_counted_by_its_weights_not_its_packed_bytes():
    """QLoRA's headline said 227.3M parameters for a 373.9M model (4-bit weights packed two a
    byte); peft says 373.9M, and which of them train."""
    plain = json.loads(_cli("--size", "tiny", "--seq-len", "32", "--json").stdout)
    res = _cli("--size", "tiny", "--seq-len", "32", "--lora-r", "8", "--load-in-4bit", "--json")
    qlora = json.loads(res.stdout)
    adapters = qlora["trainable_count"]
    assert 0 < adapters < plain["parameters_count"]
    assert qlora["parameters_count"] == plain["parameters_count"] + adapters
    assert plain["trainable_count"] == plain["parameters_count"]
