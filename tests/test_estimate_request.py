"""The estimate planned once (:mod:`collector.estimate.request`): every flag checked before any
trace or child process, for ``--size``, ``--config`` and ``--script`` alike; the request is the
file a script's child reads; the command's flags and the request's are one list."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from collector.cli.subcommands import build_parser
from collector.estimate.request import (
    DEFAULT_TIME_LIMIT,
    EstimateFlags,
    EstimateRequest,
    ScriptSubject,
    plan_estimate,
)
from collector.estimate.spec import Spec
from collector.model.errors import EstimateError

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "benchmarks" / "configs"


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "collector.cli", "estimate", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


@pytest.fixture
def script(tmp_path) -> Path:
    """A script that leaves a mark when it runs (a child started it)."""
    path = tmp_path / "train.py"
    path.write_text("open('ran', 'w').write('yes')\n")
    return path


def _subjects(script: Path) -> dict[str, list[str]]:
    config = next(iter(sorted(CONFIG.glob("*.json"))))
    return {
        "size": ["--size", "tiny"],
        "config": ["--config", str(config)],
        "script": ["--script", str(script)],
    }


@pytest.mark.parametrize("subject", ["size", "config", "script"])
@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (["--gpu", "NOPE"], "--gpu NOPE: not a GPU stepmem knows"),
        (["--gpu", "H100-80GB", "--margin", "80"], "--margin 80: a percentage from 0 to 50"),
        (["--memory-fraction", "7"], "--memory-fraction 7: a fraction above 0 and at most 1"),
        (["--margin", "80"], "--margin 80"),
        (["--alloc-conf", "max_split_size_mb:1"], "torch requires more than 20"),
    ],
)
def test_a_bad_flag_is_one_line_exit_2_before_anything_runs(
    tmp_path, script, subject, bad, says, record_fault
):
    r = _cli(*_subjects(script)[subject], *bad, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == r.stderr.strip().splitlines()[0], r.stderr
    assert r.stderr.startswith("stepmem estimate: ") and says in r.stderr, r.stderr
    assert r.stdout == ""
    assert not (tmp_path / "ran").exists()  # no child ran the script
    record_fault(
        f"bad input: stepmem estimate --{subject} … {' '.join(bad)}",
        r.stderr.strip()[:160],
        exit_code=2,
    )


def test_every_estimate_flag_is_a_field_of_the_flags():
    """The parser's flags and :class:`EstimateFlags` are one list: a flag added to one and not
    the other fails here (the output flags are the command's own)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    dests = {
        a.dest
        for a in sub.choices["estimate"]._actions
        if a.dest not in ("help", "out", "force", "json")
    }
    assert dests == {f.name for f in fields(EstimateFlags)}


def test_a_script_request_crosses_to_the_child_as_data_and_back(script):
    req = plan_estimate(
        EstimateFlags(
            script=script,
            script_args=("--lr", "1"),
            gpu="L4",
            margin=5.0,
            memory_fraction=0.5,
            alloc_conf="expandable_segments:True",
        ),
        cuda=False,
    )
    assert req.script == ScriptSubject(script.resolve(), ("--lr", "1"))
    assert req.time_limit == DEFAULT_TIME_LIMIT
    back = EstimateRequest.from_dict(json.loads(json.dumps(req.to_dict())))
    assert back == req
    assert back.target is not None and back.target.card.name == "NVIDIA L4"
    assert back.target.margin == 0.05 and back.allocator.expandable_segments


def test_a_spec_request_round_trips_too():
    req = plan_estimate(EstimateFlags(size="tiny", lora_r=4, lora_targets="q_proj"), cuda=False)
    assert isinstance(req.subject, Spec) and req.subject.lora_targets == ("q_proj",)
    assert EstimateRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req


def test_one_rule_for_the_card_without_a_gpu(script):
    """No ``--gpu`` on a machine without one: no target (no verdict) for both paths, and a
    script's counters answer as the H200's."""
    for flags in (EstimateFlags(size="tiny"), EstimateFlags(script=script)):
        req = plan_estimate(flags, cuda=False)
        assert req.target is None and req.counters_card.name == "NVIDIA H200"
    named = plan_estimate(EstimateFlags(script=script, gpu="24"), cuda=False)
    assert named.target is not None and named.counters_card == named.target.card


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"optim": "adamw_torch"}, "drop --optim"),
        ({"workload": "finetune"}, "drop --workload"),
        ({"world_size": 2}, "drop --world-size"),
        ({"max_batch": True, "gpu": "H200"}, "--max-batch with --script needs --batch-arg NAME"),
        ({"max_seq_len": True, "gpu": "H200"}, "needs --seq-len-arg NAME"),
        ({"batch_arg": "bs", "gpu": "H200"}, "--batch-arg is for --max-batch with --script"),
        ({"max_batch": True, "batch_arg": "bs"}, "--max-batch needs --gpu"),
        ({"max_batch": True, "batch_arg": "b s", "gpu": "24"}, "an option's name"),
        (
            {"max_batch": True, "batch_arg": "bs", "gpu": "24", "script_args": ("--bs", "x")},
            "--bs x: the script's value is not a whole number",
        ),
        (
            {"max_batch": True, "batch_arg": "bs", "gpu": "24", "script_args": ("--bs=0",)},
            "--bs 0: the search starts from 1",
        ),
        ({"time_limit": 0.0}, "--time-limit 0"),
    ],
)
def test_what_a_script_decides_is_refused_with_it(script, flags, says):
    with pytest.raises(EstimateError, match=says):
        plan_estimate(EstimateFlags(script=script, **flags), cuda=False)


def test_a_scripts_search_option_is_set_where_it_is_given_or_added(script):
    """``--batch-arg`` names the script's own option: a search sets it where the arguments give
    it (``--bs 4`` or ``--bs=4``), or adds it; the request carries it to the child."""
    req = plan_estimate(
        EstimateFlags(
            script=script,
            script_args=("--lr", "1", "--bs", "4", "--x=--bs"),
            gpu="24",
            max_batch=True,
            batch_arg="bs",
        ),
        cuda=False,
    )
    s = req.script
    assert s is not None and s.search_arg == "--bs" and s.value() == 4 and req.search == "batch"
    assert s.at(9).args == ("--lr", "1", "--bs", "9", "--x=--bs")
    assert replace(s, args=("--bs=2",)).at(9).args == ("--bs=9",)
    assert replace(s, args=("--lr", "1")).at(9).args == ("--lr", "1", "--bs", "9")
    assert EstimateRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req
    with pytest.raises(EstimateError, match="--batch-arg is for --script"):
        plan_estimate(EstimateFlags(size="tiny", batch_arg="bs"), cuda=False)


def test_a_request_file_that_is_not_one_is_an_estimate_error():
    with pytest.raises(EstimateError, match="cannot be read"):
        EstimateRequest.from_dict({"subject": {"script": "x"}})


def test_the_subcommand_table_names_what_each_parser_adds():
    """One table: each row's name is the subcommand its parser adds, in the table's order."""
    from collector.cli.subcommands import SUBCOMMANDS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == [s.name for s in SUBCOMMANDS]


@pytest.mark.parametrize("what", ["the script", "a file that is not an estimate"])
def test_out_never_overwrites_what_is_not_an_estimate(tmp_path, script, what, record_fault):
    """``--out train.py`` (the script itself, or any file that is not a stepmem estimate) is
    refused before anything runs, and the file is left as it was; ``--force`` overwrites the
    second (never the script)."""
    target = script if what == "the script" else tmp_path / "notes.txt"
    if what != "the script":
        target.write_text("my notes\n")
    before = target.read_bytes()
    r = _cli("--size", "tiny", "--out", str(target), cwd=tmp_path)
    if what == "the script":
        r = _cli("--script", str(script), "--out", str(target), cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert target.read_bytes() == before and not (tmp_path / "ran").exists()
    record_fault(f"bad input: stepmem estimate --out naming {what}", r.stderr.strip()[:160])
    if what != "the script":
        r = _cli("--size", "tiny", "--out", str(target), "--force", "--json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert json.loads(target.read_text())["format"] == 1


def test_progress_reaches_a_file_or_pipe_as_plain_lines(tmp_path):
    """An estimate whose stderr is a file (a CI log) says what it is doing as it goes, a plain
    line each (no bar, no terminal codes); ``--json`` keeps stderr quiet."""
    r = _cli("--size", "tiny", cwd=tmp_path)  # stderr is a pipe here
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines and all(x.startswith("… ") for x in lines), r.stderr
    assert any("tracing tiny" in x for x in lines)
    assert "\x1b" not in r.stderr and "\r" not in r.stderr
    r = _cli("--size", "tiny", "--json", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def _parsed(args: list[str]) -> EstimateFlags:
    return EstimateFlags.of(build_parser().parse_args(["estimate", *args]))


def _quantised_config(tmp_path, q):
    from collector.estimate.spec import SHAPES

    cfg = {"model_type": "llama", **SHAPES["tiny"], "quantization_config": q}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    ("q", "says"),
    [
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "8-bit weights"),
        ({"quant_method": "gptq", "bits": 4}, "(gptq) is not modelled"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "add --lora-r R"),
    ],
)
def test_a_configs_quantization_is_honoured_or_refused_by_name(tmp_path, q, says):
    """#37: a pre-quantised checkpoint's config is not estimated as a full-precision model."""
    path = _quantised_config(tmp_path, q)
    with pytest.raises(EstimateError, match=re.escape(says)):
        plan_estimate(_parsed(["--config", str(path)]), cuda=False)


def test_a_4bit_quantization_config_is_the_4bit_base(tmp_path):
    path = _quantised_config(tmp_path, {"quant_method": "bitsandbytes", "load_in_4bit": True})
    spec = plan_estimate(_parsed(["--config", str(path), "--lora-r", "8"]), cuda=False).spec
    assert spec.load_in_4bit and spec.lora_r == 8
    from collector.estimate.trace import estimate

    by_config = estimate(replace(spec, seq_len=32))
    plain = dict(spec.config)
    del plain["quantization_config"]
    by_flag = estimate(replace(spec, config=plain, seq_len=32))
    assert by_config.at_end == by_flag.at_end and by_config.steady == by_flag.steady
