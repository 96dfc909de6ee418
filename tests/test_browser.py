"""A real browser on what users open: the HTML timeline of a replayed run and Prometheus' own graph
page for its pushed series, in headless Chromium (Debian's, driven by Playwright). Every request
the pages make must stay on this machine (file:// or 127.0.0.1); screenshots are kept when
``STEPMEM_SCREENSHOTS`` names a folder (the committed ones: ``benchmarks/results/browser/``)."""

from __future__ import annotations

import os
import shutil
import urllib.parse
from pathlib import Path

import pytest

from collector.export.remote_write import RemoteWriteConfig
from tests.conftest import loopback, wait_for
from tests.prom import Prometheus

pytest.importorskip("playwright")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(
        CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium)"
    ),
]
RUN = "t-browser"


def _local(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme in ("file", "data", "blob", "about") or parts.hostname == "127.0.0.1"


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            # no sandbox as root in CI; WebGL (the timeline's trace) on the CPU rasterizer
            args=["--no-sandbox", "--use-angle=swiftshader", "--enable-unsafe-swiftshader"],
        )
        try:
            yield b
        finally:
            b.close()


def _page(browser, shots: list):
    """A page that refuses any request off this machine and records it, and page errors."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    off, errors = [], []

    def route(r):
        if _local(r.request.url):
            r.continue_()
        else:
            off.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
    shots.append((off, errors))
    return page


def _shot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    keep = os.environ.get("STEPMEM_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / name)
    return path


def test_the_timeline_and_prometheus_graph_of_a_replayed_run_render(ray_cluster, browser, tmp_path):
    from collector.analysis.runs import load_run
    from collector.analysis.timeline import render_html
    from collector.model.settings import JobOptions
    from collector.run.job import run_job

    prom = Prometheus(tmp_path / "prom").start()
    pages: list = []
    try:
        rw = RemoteWriteConfig(url=f"{prom.url}/api/v1/write", flush_interval_s=0.2)
        res = run_job(
            JobOptions(
                backend="replay",
                captures=["outside"],
                speed=4.0,
                store=tmp_path / "runs",
                sampler=loopback(run_id=RUN, workload="patterns", remote_write=rw),
            ),
            echo=lambda *a: None,
        )
        html = render_html(load_run(res.store), tmp_path / "timeline.html")

        # 1. the HTML timeline: every trace drawn, the 8 steps' peaks labelled
        page = _page(browser, pages)
        page.goto(html.as_uri())
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30_000)
        data = page.evaluate(
            "() => document.querySelector('.js-plotly-plot').data"
            ".map(t => ({name: t.name, n: (t.y || []).length, text: t.text || []}))"
        )
        by_name = {d["name"]: d for d in data}
        assert by_name["NVML used (full rate)"]["n"] > 100  # the full-rate trace
        assert by_name["NVML within-step peak"]["text"] == [f"step {i}" for i in range(1, 9)]
        # the same story as the PNG: the reading at each step's end beside its peak
        assert by_name["NVML at step end"]["text"] == [f"step {i}" for i in range(1, 9)]
        # the WebGL trace is on screen: its canvas has non-blank pixels
        assert page.evaluate(
            "() => { const c = document.querySelector('.js-plotly-plot canvas');"
            " return !!c && c.width > 0 && c.height > 0; }"
        )
        shot = _shot(page, tmp_path, "timeline.png")
        assert shot.stat().st_size > 20_000

        # 2. Prometheus' graph page for the run's pushed step series (the run has ended, so its
        # series are marked stale: the console tab asks for their last value in 10 minutes)
        series = f'stepmem_step_nvml_end_bytes{{run="{RUN}"}}'
        last = f"last_over_time({series}[10m])"
        wait_for(lambda: prom.query(last), timeout=30)
        q = urllib.parse.urlencode({"g0.expr": last, "g0.tab": "1"})
        page = _page(browser, pages)
        page.goto(f"{prom.url}/graph?{q}")
        page.get_by_text(f'run="{RUN}"').first.wait_for(timeout=30_000)
        assert "stepmem_step_nvml_end_bytes" in page.content()
        _shot(page, tmp_path, "prometheus-console.png")
        q = urllib.parse.urlencode({"g0.expr": last, "g0.tab": "0", "g0.range_input": "5m"})
        page = _page(browser, pages)
        page.goto(f"{prom.url}/graph?{q}")
        # the graph tab draws the series as a line (an SVG path with segments)
        page.wait_for_function(
            "() => [...document.querySelectorAll('svg path')]"
            ".some(p => (p.getAttribute('d') || '').includes('L'))",
            timeout=30_000,
        )
        _shot(page, tmp_path, "prometheus-graph.png")
    finally:
        prom.stop()
    for off, _ in pages:
        assert off == [], f"requests off this machine: {off}"
    timeline_errors = pages[0][1]
    assert timeline_errors == []  # our page; Prometheus' classic UI (Debian's build) logs one
    # script error of its own ("Unexpected token 'export'") and works all the same
