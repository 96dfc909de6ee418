"""A real Prometheus (Debian's package) on loopback, started from the project's own config."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def require(binary: str) -> str:
    """The binary's path; a CI run without it fails (setup installs it), elsewhere it skips."""
    path = shutil.which(binary)
    if path is None:
        msg = f"{binary} is not installed (./scripts/setup installs it as root)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, workdir: Path, port: int | None = None, scrape_s: float = 1.0) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets = workdir / "targets"
        self.targets.mkdir(parents=True, exist_ok=True)
        cfg = yaml.safe_load(CONFIG.read_text())  # the project's config, with test timings
        ms = f"{int(scrape_s * 1000)}ms"
        cfg["global"].update(scrape_interval=ms, scrape_timeout=ms)
        # The rule files, by absolute path (the config is written elsewhere); no Alertmanager.
        cfg["rule_files"] = [str(CONFIG.parent / f) for f in cfg.get("rule_files", [])]
        cfg.pop("alerting", None)
        for job in cfg["scrape_configs"]:
            for sd in job.get("file_sd_configs", []):
                sd["files"] = [str(self.targets / "*.json")]
                sd["refresh_interval"] = "1s"
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.proc: subprocess.Popen | None = None

    def start(self) -> Prometheus:
        self.proc = subprocess.Popen(
            [
                require("prometheus"),
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-remote-write-receiver",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.workdir / "prometheus.log", "ab"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"Prometheus did not get ready; log: {self.workdir / 'prometheus.log'}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(15)
            self.proc = None

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's ``label_values(match, label)`` asks Prometheus: the label's values on
        the series ``match`` selects."""
        q = urllib.parse.urlencode({"match[]": match})
        url = f"{self.url}/api/v1/label/{label}/values?{q}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def scalar(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None
