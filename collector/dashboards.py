"""Grafana dashboards as code (grafana-foundation-sdk, Grafana 11 models).

``stepmem dashboards --out grafana/dashboards`` writes the JSON that is committed there; a test
regenerates it and fails when the committed files drift. Two dashboards:

* **stepmem / Step memory** — one run, one node, one GPU or several: NVML at high resolution with
  its window max; per step, NVML within-step peak against the end-of-step reading; torch
  allocated and reserved, peak and end; reserved − allocated; memory outside the allocator; the
  ledger stacked; step boundaries as annotations.
* **stepmem / Fleet** — every GPU's headroom, memory growth per run, firing alerts, and the
  collector's own health.

Per-step series come from remote write (``job="stepmem-steps"``, one point per step at its end
time), the high-resolution trace from ``job="stepmem-samples"``, the rest from scrapes
(``job="stepmem"``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import bargauge, common, dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dashboard_models

__all__ = ["DASHBOARDS", "build_all", "expressions", "write_all"]

DS = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'run=~"$run", node=~"$node", gpu_uuid=~"$gpu"'
STEPS = f'job="stepmem-steps", {SEL}, rank=~"$rank"'
SCRAPED = f'job="stepmem", {SEL}'
SAMPLES = f'job="stepmem-samples", {SEL}'
GPU_LEGEND = "{{node}} GPU {{gpu}}"
RANK_LEGEND = "{{node}} GPU {{gpu}} rank {{rank}}"  # per-step series: one a rank
# a rank's allocated peak above the median of its run's ranks (the report's imbalance finding)
ABOVE_MEDIAN = (
    f"stepmem_step_torch_allocated_peak_bytes{{{STEPS}}} - on (run, workload) group_left "
    f"quantile by (run, workload) (0.5, stepmem_step_torch_allocated_peak_bytes{{{STEPS}}})"
)

NVML_VS_TORCH = (
    "NVML 'used' is everything on the device: the torch allocator's reserved pool, the CUDA "
    "context, other libraries' allocations and CUDA managed (paged) memory resident there. "
    "torch 'reserved' is what the caching allocator holds; 'allocated' is what live tensors use. "
)


def _query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)


def _ts(
    title: str,
    description: str,
    unit: str,
    queries: list[tuple[str, str]],
    *,
    points: bool = False,
    stack: bool = False,
    w: int = 12,
    h: int = 8,
) -> timeseries.Panel:
    p = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DS)
        .span(w)
        .height(h)
        .line_width(1)
        .fill_opacity(10 if not stack else 60)
    )
    if points:  # one point per step: draw the points, join them
        p = p.show_points(common_models.VisibilityMode.ALWAYS).point_size(4)
    if stack:
        p = p.stacking(common.StackingConfig().mode(common_models.StackingMode.NORMAL))
    for i, (expr, legend) in enumerate(queries):
        p = p.with_target(_query(expr, legend, chr(ord("A") + i)))
    return p


def _variables(d: dashboard.Dashboard) -> dashboard.Dashboard:
    d = d.with_variable(
        dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    )
    # a run's GPUs from what the samplers serve (scraped) or push (remote write): a run that
    # reached Prometheus only by remote write is listed too
    either = '__name__=~"stepmem_nvml_total_bytes|stepmem_step", job=~"stepmem|stepmem-steps"'
    steps = 'job="stepmem-steps", run=~"$run", node=~"$node", gpu_uuid=~"$gpu"'
    for name, label, query in (
        ("run", "Run", f"label_values({{{either}}}, run)"),
        ("node", "Node", f'label_values({{{either}, run=~"$run"}}, node)'),
        ("gpu", "GPU", f'label_values({{{either}, run=~"$run", node=~"$node"}}, gpu_uuid)'),
        # ranks of a distributed run (0 for one process): from the pushed per-step series
        ("rank", "Rank", f"label_values(stepmem_step{{{steps}}}, rank)"),
    ):
        d = d.with_variable(
            dashboard.QueryVariable(name)
            .label(label)
            .datasource(DS)
            .query(query)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
    return d


def _device_panels() -> list[Any]:
    """NVML's side: the whole device, per step and outside the allocator."""
    return [
        dashboard.Row("NVML: the whole device"),
        _ts(
            "NVML used, high resolution",
            "NVML v2 'used' at the sampler's rate (pushed as per-millisecond maxima), and its "
            "maximum over the trailing window (stepmem_window_seconds) from scrapes: it keeps "
            "short peaks that a scrape would miss. " + NVML_VS_TORCH,
            "bytes",
            [
                (f"stepmem_nvml_used_bytes{{{SAMPLES}}}", GPU_LEGEND + " used (1 ms max)"),
                (f"stepmem_nvml_used_window_max_bytes{{{SCRAPED}}}", GPU_LEGEND + " window max"),
                (f"stepmem_nvml_used_bytes{{{SCRAPED}}}", GPU_LEGEND + " used (scraped)"),
            ],
            w=24,
        ),
        _ts(
            "Per step: NVML within-step peak vs end-of-step reading",
            "One point per step at its end time. The gap between the two lines is memory that came "
            "and went inside the step: an end-of-step reading (nvidia-smi, torch.cuda.memory_* in "
            "on_step_end) never shows it.",
            "bytes",
            [
                (f"stepmem_step_nvml_peak_bytes{{{STEPS}}}", RANK_LEGEND + " peak"),
                (f"stepmem_step_nvml_end_bytes{{{STEPS}}}", RANK_LEGEND + " end"),
            ],
            points=True,
        ),
        _ts(
            "Memory outside the torch allocator (end of step)",
            "NVML used − torch reserved − the CUDA context measured before training. Grows with "
            "CUDA managed memory (bitsandbytes paged optimizer state), other libraries' "
            "cudaMalloc and NCCL buffers; torch's own statistics never show it.",
            "bytes",
            [(f"stepmem_step_nontorch_bytes{{{STEPS}}}", RANK_LEGEND)],
            points=True,
        ),
    ]


def _allocator_panels() -> list[Any]:
    """The torch allocator: its peaks and ends, its cache."""
    return [
        dashboard.Row("The torch allocator"),
        _ts(
            "torch allocated and reserved: within-step peak vs end",
            "allocated: bytes in live tensors; reserved: bytes the caching allocator holds from "
            "the driver (used or cached). Peaks are reset at each step begin. A reserved end that "
            "jumps once (step 2, with a new optimizer's state) and then stays flat is normal.",
            "bytes",
            [
                (
                    f"stepmem_step_torch_allocated_peak_bytes{{{STEPS}}}",
                    RANK_LEGEND + " allocated peak",
                ),
                (
                    f"stepmem_step_torch_allocated_end_bytes{{{STEPS}}}",
                    RANK_LEGEND + " allocated end",
                ),
                (
                    f"stepmem_step_torch_reserved_peak_bytes{{{STEPS}}}",
                    RANK_LEGEND + " reserved peak",
                ),
                (
                    f"stepmem_step_torch_reserved_end_bytes{{{STEPS}}}",
                    RANK_LEGEND + " reserved end",
                ),
            ],
            points=True,
        ),
        _ts(
            "Allocator cache and fragmentation (reserved − allocated, end of step)",
            "Memory the caching allocator holds but no tensor uses at step end: cached blocks and "
            "fragmentation. Large and growing values point at fragmentation "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).",
            "bytes",
            [
                (
                    f"stepmem_step_torch_reserved_end_bytes{{{STEPS}}} - "
                    f"stepmem_step_torch_allocated_end_bytes{{{STEPS}}}",
                    RANK_LEGEND,
                )
            ],
            points=True,
        ),
    ]


def _rank_panels() -> list[Any]:
    """Ranks side by side, the ledger, the prediction, every byte at step end."""
    return [
        dashboard.Row("Ranks"),
        _ts(
            "Per rank: torch allocated within-step peak",
            "Each rank's allocated peak, one point per step: ranks of a data-parallel run should "
            "lie together; one above the others holds more (a bigger batch, an uneven shard, a "
            "cache of its own). Its ledger below says which kind.",
            "bytes",
            [
                (
                    f"max by (rank) (stepmem_step_torch_allocated_peak_bytes{{{STEPS}}})",
                    "rank {{rank}}",
                )
            ],
            points=True,
        ),
        _ts(
            "Per rank: above the run's median",
            "A rank's allocated peak minus the median over the run's ranks (the report's "
            "imbalance finding, and StepMemRankImbalance's). 0 for a balanced run.",
            "bytes",
            [(ABOVE_MEDIAN, RANK_LEGEND)],
            points=True,
        ),
        _ts(
            "Memory ledger at step end",
            "Where allocated memory goes: parameters, gradients, optimizer state on the device, "
            "optimizer state in CUDA managed memory (paged; outside the allocator), and the rest "
            "(activations, temporaries).",
            "bytes",
            [(f"stepmem_step_ledger_bytes{{{STEPS}}}", RANK_LEGEND + " {{kind}}")],
            stack=True,
            w=24,
        ),
        _ts(
            "Predicted vs measured peak",
            "The allocated peak `stepmem estimate` predicted (fake tensors and torch's MemTracker; "
            "a probe given STEPMEM_ESTIMATE) beside the allocator's measured peak and NVML's "
            "within-step peak. `stepmem report RUN --estimate FILE` names the differences.",
            "bytes",
            [
                (f"stepmem_step_estimate_peak_bytes{{{STEPS}}}", RANK_LEGEND + " predicted"),
                (
                    f"stepmem_step_torch_allocated_peak_bytes{{{STEPS}}}",
                    RANK_LEGEND + " allocated peak",
                ),
                (f"stepmem_step_nvml_peak_bytes{{{STEPS}}}", RANK_LEGEND + " NVML peak"),
            ],
            w=24,
        ),
        _ts(
            "Every byte at step end",
            "NVML used at each step's end by component (stepmem_step_account_bytes; they sum to "
            "NVML end): baseline (the CUDA context before training), torch reserved, first use "
            "(cuBLAS workspaces, NCCL buffers kept), outside torch in the training process, other "
            "processes, memory no process is charged for (CUDA managed/UVM, e.g. paged optimizer "
            "state), remainder; 'outside_torch_unsplit' where NVML gave no per-process readings.",
            "bytes",
            [(f"stepmem_step_account_bytes{{{STEPS}}}", RANK_LEGEND + " {{component}}")],
            stack=True,
            w=24,
        ),
    ]


def _fleet_panels() -> list[Any]:
    """Every GPU: headroom, growth per run, stepmem's alerts."""
    return [
        bargauge.Panel()
        .title("Headroom: window peak / capacity")
        .description(
            "Largest NVML used over the trailing window divided by the card's memory, "
            "per GPU. Above 95 % the next larger batch runs out of memory."
        )
        .unit("percentunit")
        .min(0)
        .max(1)
        .datasource(DS)
        .span(12)
        .height(8)
        .with_target(
            _query(
                f"stepmem_nvml_used_window_max_bytes{{{SCRAPED}}} / "
                f"stepmem_nvml_total_bytes{{{SCRAPED}}}",
                GPU_LEGEND,
                "A",
            )
        ),
        _ts(
            "Memory growth per run (end of step, per second)",
            "Rate of change of NVML used at step end, summed over a run's GPUs: flat after warm-up "
            "is healthy, a lasting positive rate is a leak.",
            "Bps",
            [
                (
                    "sum by (run) "
                    f"(deriv(stepmem_step_nvml_end_bytes{{{STEPS}}}[$__rate_interval]))",
                    "{{run}}",
                )
            ],
        ),
        _ts(
            "stepmem alerts",
            "stepmem's alerts, pending or firing (1 while active).",
            "short",
            [('ALERTS{alertname=~"StepMem.*"}', "{{alertname}} {{alertstate}} {{gpu_uuid}}")],
        ),
    ]


def _collector_panels() -> list[Any]:
    """The collector's own health."""
    return [
        dashboard.Row("The collector"),
        _ts(
            "Sampler targets up",
            "Prometheus' view of each sampler's /metrics (1 = scraped).",
            "short",
            [(f"up{{{SCRAPED}}}", GPU_LEGEND)],
            w=8,
        ),
        _ts(
            "Achieved sample rate",
            "NVML samples per second over the last 5 s, against the target.",
            "hertz",
            [
                (f"stepmem_sampler_rate_hz{{{SCRAPED}}}", GPU_LEGEND + " achieved"),
                (f"stepmem_sampler_target_rate_hz{{{SCRAPED}}}", GPU_LEGEND + " target"),
            ],
            w=8,
        ),
        _ts(
            "Drops and errors",
            "Per second: step events rejected, remote-write samples dropped, NVML errors.",
            "short",
            [
                (
                    f"sum by (node, gpu, reason) "
                    f"(rate(stepmem_sampler_dropped_total{{{SCRAPED}}}[$__rate_interval]))",
                    GPU_LEGEND + " events {{reason}}",
                ),
                (
                    f"sum by (node, gpu, reason) "
                    f"(rate(stepmem_remote_write_dropped_total{{{SCRAPED}}}[$__rate_interval]))",
                    GPU_LEGEND + " remote write {{reason}}",
                ),
                (
                    f"sum by (node, gpu, kind) "
                    f"(rate(stepmem_sampler_errors_total{{{SCRAPED}}}[$__rate_interval]))",
                    GPU_LEGEND + " NVML {{kind}}",
                ),
            ],
            w=8,
        ),
    ]


def _dashboard(
    title: str, uid: str, description: str, since: str, refresh: str, items: list[Any]
) -> dashboard.Dashboard:
    """A dashboard with stepmem's header and variables, and ``items`` (rows and panels) in
    order."""
    d = (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["stepmem", "gpu", "memory"])
        .time(since, "now")
        .refresh(refresh)
    )
    d = _variables(d)
    for item in items:
        d = d.with_row(item) if isinstance(item, dashboard.Row) else d.with_panel(item)
    return d


def step_memory() -> dashboard.Dashboard:
    d = _dashboard(
        "stepmem / Step memory",
        "stepmem-step-memory",
        "GPU memory inside every training step, for one run.",
        "now-30m",
        "10s",
        [*_device_panels(), *_allocator_panels(), *_rank_panels()],
    )
    return d.annotation(
        dashboard.AnnotationQuery()
        .name("Steps")
        .datasource(DS)
        .enable(True)
        .icon_color("rgba(120, 120, 120, 0.5)")
        .expr(f"changes(stepmem_step{{{STEPS}}}[$__interval]) > 0")
    )


def fleet() -> dashboard.Dashboard:
    return _dashboard(
        "stepmem / Fleet",
        "stepmem-fleet",
        "Every GPU stepmem watches: headroom, growth, alerts, collector health.",
        "now-6h",
        "30s",
        [*_fleet_panels(), *_collector_panels()],
    )


DASHBOARDS = {"stepmem-step-memory.json": step_memory, "stepmem-fleet.json": fleet}


def to_json(d: dashboard.Dashboard) -> str:
    return json.dumps(d.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def build_all() -> dict[str, str]:
    return {name: to_json(make()) for name, make in DASHBOARDS.items()}


def write_all(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in build_all().items():
        (out / name).write_text(text)
        paths.append(out / name)
    return paths


def expressions(model: dict[str, Any]) -> list[str]:
    """Every PromQL expression in a dashboard's JSON: panel targets, variables, annotations."""
    out = []
    for panel in model.get("panels", []):
        out += [t["expr"] for t in panel.get("targets", []) if "expr" in t]
        for inner in panel.get("panels", []):
            out += [t["expr"] for t in inner.get("targets", []) if "expr" in t]
    for var in model.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            out.append(var["query"] if isinstance(var["query"], str) else var["query"]["query"])
    for ann in model.get("annotations", {}).get("list", []):
        if "expr" in ann:
            out.append(ann["expr"])
    return out
