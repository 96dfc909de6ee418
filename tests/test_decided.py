"""Whether a placeholder decided a script's figures (:mod:`collector.estimate.script.decided`):
two traces, the place their allocations part, the line said; an estimate file carries the doubt
and one written before it reads as carrying none."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from collector.estimate.render import render
from collector.estimate.script.decided import Trace, decided
from collector.model.prediction import Estimate

ROOT = Path(__file__).resolve().parent.parent
# a committed estimate held against a card (written before the check existed)
COMMITTED = ROOT / "benchmarks/results/fit/predicted/cpu/h200-fit-7b-adamw_8bit.json"


def _est() -> Estimate:
    return Estimate.from_dict(json.loads(COMMITTED.read_text()))


def test_the_same_figures_decide_nothing_whatever_the_trails():
    est = _est()
    a = Trace(est, answered=3, trail=(("t.py:4", "aa"), ("t.py:9", "bb")), end="cc")
    b = Trace(est, answered=3, trail=(("t.py:4", "aa"), ("t.py:9", "xx")), end="yy")
    assert decided(a, b) == ""


def test_the_read_before_the_allocations_part_is_named():
    est = _est()
    bigger = replace(est, steady={**est.steady, "activations": est.steady["activations"] * 2})
    trail_a = (("t.py:4", "aa"), ("t.py:7", "bb"), ("t.py:9", "cc"))
    trail_b = (("t.py:4", "aa"), ("t.py:7", "bb"), ("t.py:9", "dd"))
    line = decided(Trace(est, trail=trail_a), Trace(bigger, trail=trail_b))
    assert line.startswith("a value read from a fake tensor at t.py:7 decides what is allocated")
    # parting before the first read: not a placeholder's doing, the script's own randomness
    line = decided(Trace(est, trail=trail_a), Trace(bigger, trail=(("t.py:4", "zz"),)))
    assert line.startswith("two traces of the script allocated differently before it read")
    # the other trace stopped: its error is what the other placeholders gave
    line = decided(Trace(est, trail=trail_a), Trace(None, "t.py:9: boom", trail=trail_b))
    assert "other placeholders give an error (boom)" in line


def test_a_doubted_estimate_round_trips_and_gives_no_verdict():
    est = replace(_est(), undecided="a value read from a fake tensor at t.py:7 decides")
    back = Estimate.from_dict(json.loads(json.dumps(est.to_dict())))
    assert back.undecided == est.undecided
    text = render(back)
    assert text.splitlines()[1] == f"⚠ Not trustworthy: {est.undecided}."
    assert "Fits:" not in text and "Does not fit" not in text
    assert back.fit is not None
    assert "Cannot say whether it fits on NVIDIA H200: a placeholder" in text
    assert "Fits:" in render(_est())
    assert _est().undecided == ""  # written before the check: no doubt recorded


def test_the_reads_of_a_result_are_bounded_and_inert():
    reads = Trace.reads_from(
        {"answered": 7, "trail": [["\x1b[31mt.py:1", "ab"]] * 6000 + [[1]], "end": "e" * 99}
    )
    assert reads["answered"] == 7 and len(reads["trail"]) == 5000
    assert "\x1b" not in reads["trail"][0][0] and len(reads["end"]) == 32
    assert Trace.reads_from("not a dict") == {}
