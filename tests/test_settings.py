"""Settings each written once: the rate type, the sampling config, the shared flags, and what a
training process imports."""

import subprocess
import sys

import pytest

from collector.cli.subcommands import build_parser
from collector.model.settings import DEFAULT_RATE, DEFAULT_WINDOW_S, Rate, SamplerOptions, Sampling


def test_a_rate_knows_what_max_means():
    assert Rate.MAX.is_max and Rate.MAX.period_ns == 0 and str(Rate.MAX) == "max rate"
    assert Rate(1000).period_ns == 1_000_000 and str(Rate(1000)) == "1000 Hz"
    assert Rate.of("max") == Rate.MAX and Rate.of(0) == Rate.MAX and Rate.of(Rate(5)) == Rate(5)
    assert Rate(500).samples_in(2) == 1000 and Rate.MAX.samples_in(1) > 100_000
    with pytest.raises(ValueError, match="rate"):
        Rate(-1)


def test_a_sampling_config_is_checked_where_it_is_made():
    assert Sampling().rate == DEFAULT_RATE and Sampling().window_s == DEFAULT_WINDOW_S
    assert Sampling(rate=250).rate == Rate(250)  # a number of Hz is taken as one
    with pytest.raises(ValueError, match="window"):
        Sampling(window_s=0)
    with pytest.raises(ValueError, match="port"):
        SamplerOptions(metrics_port=70000)


@pytest.mark.parametrize("command", ["run", "daemon", "capture"])
def test_every_subcommand_that_samples_has_the_same_rate_flag(command):
    extra = ["--out", "x.capture.parquet"] if command == "capture" else []
    ns = build_parser().parse_args([command, *extra])
    assert ns.rate == DEFAULT_RATE
    ns = build_parser().parse_args([command, *extra, "--rate", "max"])
    assert ns.rate == Rate.MAX


@pytest.mark.parametrize("command", ["run", "daemon"])
def test_ray_metrics_is_off_unless_asked_for(command):
    from collector.args import sampler_options

    assert not sampler_options(build_parser().parse_args([command]), "r").ray_metrics
    ns = build_parser().parse_args([command, "--ray-metrics"])
    assert sampler_options(ns, "r").ray_metrics


def test_a_training_process_imports_no_sampler_side_code():
    """The probe and its lookup load without the actor, the sampling thread, NVML or the
    exporters: a training process pays only for what it uses."""
    code = (
        "import sys, collector.probe.core, collector.probe.hf, collector.lookup\n"
        "probe = collector.probe.core.StepProbe(devices=[])\n"
        "heavy = ['collector.actor', 'collector.placement', 'collector.sampler',\n"
        "         'collector.nvml', 'collector.export.prometheus', 'collector.cli']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_python_dash_m_collector_is_the_stepmem_command():
    args = ["devices", "--backend", "replay", "--capture", "idle"]
    via_m = subprocess.run(
        [sys.executable, "-m", "collector", *args], capture_output=True, text=True, timeout=120
    )
    via_main = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from collector.cli import main; sys.exit(main())",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert via_m.returncode == 0 and via_m.stdout == via_main.stdout and "GPU-" in via_m.stdout
