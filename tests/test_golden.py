"""Golden cases: every committed capture and run store has a file in ``tests/golden/cases/`` of
what its report must say (its verdict first) and must not say. The cases are data; this one
test reads them all. A capture is reported as ``stepmem report X.capture.parquet`` does: its
samples and step events joined offline through the sampler's own join.

Besides each file's expectations, every report must hold what the diagnosis promises: no two
findings of a stream that disagree (``diagnosis.contradictions``), a verdict of one to three
lines, findings of at most two lines, and no negative memory figure anywhere.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml

from collector.analysis.diagnose_run import diagnose_run
from collector.analysis.diagnosis import contradictions, verdict
from collector.analysis.diagnosis.kinds import LINE
from collector.analysis.diagnosis.numbers import NUMBERS, unknown_keys
from collector.analysis.report import render
from collector.analysis.runs import load_run

ROOT = Path(__file__).resolve().parent.parent
CASES = sorted((Path(__file__).parent / "golden" / "cases").glob("*.yml"))
WIDTH = LINE  # the report's width, less a finding's bullet


def _flat(text: str) -> str:
    return " ".join(text.split())


def _verdicts(text: str) -> list[str]:
    """The verdict lines of every stream's report."""
    out, inside = [], False
    for line in text.splitlines():
        if line.strip() == "Verdict":
            inside = True
            continue
        if line.strip() == "Findings":
            inside = False
        elif inside:
            out.append(line.strip())
    return out


def test_every_committed_capture_and_run_store_has_a_golden_case():
    sources = {yaml.safe_load(p.read_text())["source"] for p in CASES}
    captures = {p.relative_to(ROOT).as_posix() for p in (ROOT / "captures").glob("*.parquet")}
    stores = {
        p.parent.relative_to(ROOT).as_posix()
        for p in (ROOT / "benchmarks" / "results").glob("*/runs/*/meta.json")
    }
    assert captures | stores <= sources, sorted((captures | stores) - sources)


@pytest.mark.parametrize("case", CASES, ids=[p.stem for p in CASES])
def test_golden_case(case: Path):
    spec = yaml.safe_load(case.read_text())
    run = load_run(ROOT / spec["source"])
    diagnosis = diagnose_run(run)
    text, findings = render(run, diagnosis), diagnosis.findings
    # the diagnosis as data: the kinds of finding it makes, and every figure a named one
    assert sorted({f.rule for fs in findings.values() for f in fs}) == spec["findings"]
    for fs in findings.values():
        for f in fs:
            assert unknown_keys(f) == [], f"{case.name}: {f.rule} carries {unknown_keys(f)}"
    flat = _flat(text)
    head = _flat(" ".join(_verdicts(text)))
    for pattern in spec.get("verdict") or []:
        assert re.search(pattern, head), f"{case.name}: verdict lacks /{pattern}/:\n{head}"
    for pattern in spec.get("must_say") or []:
        assert re.search(pattern, flat), f"{case.name}: report lacks /{pattern}/:\n{text}"
    for pattern in spec.get("must_not_say") or []:
        hit = re.search(pattern, flat)
        assert not hit, f"{case.name}: report says /{pattern}/ ({hit.group(0)!r}):\n{text}"
    # what every report promises
    assert not re.search(r"(?<![\w.])[−-]\d+\.\d\d GiB(?! at step)", flat.replace("→", " ")), (
        "a negative memory figure outside a change"
    )
    for fs in findings.values():
        assert contradictions(fs) == [], contradictions(fs)
        assert 1 <= len(verdict(fs)) <= 3, verdict(fs)
        for f in fs:
            if not f.minor:
                lines = textwrap.wrap(f.text, WIDTH)
                assert len(lines) <= 2, f"{case.name}: a finding of {len(lines)} lines: {f.text}"


def test_every_kind_of_finding_declares_its_numbers_and_a_stray_key_is_named():
    from collector.analysis.diagnosis import Finding, FindingKind

    assert set(NUMBERS) == set(FindingKind)
    f = Finding(FindingKind.JUMP, "x", {"from_step": 1, "to_stpe": 2})
    assert unknown_keys(f) == ["to_stpe"]
