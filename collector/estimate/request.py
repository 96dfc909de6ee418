"""An estimate planned once: :class:`EstimateFlags` (what the user asked, ``None`` where a flag
was not given) become an :class:`EstimateRequest` in :func:`plan_estimate` — every default and
every check of ``stepmem estimate`` in this one place, before anything is traced or any child
process starts, for ``--size``, ``--config`` and ``--script`` alike (as
:func:`collector.run.job.plan_job` plans a job).

The request says what is estimated (a :class:`~collector.estimate.spec.Spec`, or a
:class:`ScriptSubject`: the user's script with its arguments and time limit), the caching
allocator's settings, the GPU the step is held against (:class:`~collector.estimate.fit.Target`,
or none), the card ``torch.cuda``'s counters answer from, and the search (``--max-batch``,
``--max-seq-len``). It is also the file a script's child process reads
(:meth:`EstimateRequest.to_dict` / :meth:`~EstimateRequest.from_dict`).

One rule for the card: ``--gpu`` names it, else this machine's GPU; without either there is no
target (no verdict on fitting), and a script's counters (``mem_get_info`` …) answer as the H200,
the card stepmem measured.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import collector.estimate.fit as fit
import collector.estimate.gpus as gpus
from collector.estimate.allocator_config import AllocatorConfig
from collector.estimate.spec import Spec, read_config
from collector.model.errors import EstimateError
from collector.model.plans import KNOBS, Knob
from collector.model.untrusted import inert

__all__ = [
    "DEFAULT_MARGIN",
    "DEFAULT_TIME_LIMIT",
    "EstimateFlags",
    "EstimateRequest",
    "ScriptSubject",
    "plan_estimate",
]

DEFAULT_MARGIN = 2.0  # percent of what torch may reserve, kept free when judging a fit
DEFAULT_TIME_LIMIT = 900.0  # seconds one trace may take (a script: to its second probe step)
DEFAULT_WORKLOAD = "finetune"
COUNTERS_CARD = "H200"  # a script's torch.cuda counters without a GPU to hold it against
MAX_TIME_LIMIT = 7 * 24 * 3600.0


@dataclass(frozen=True)
class EstimateFlags:
    """``stepmem estimate``'s flags as given (``None``/``False``: not given). The command's
    parser has one flag per field, of the same name (a test holds the two together)."""

    workload: str | None = None
    shard: str | None = None
    world_size: int | None = None
    size: str | None = None
    config: Path | None = None
    like: Path | None = None
    optim: str | None = None
    seq_len: int | None = None
    batch: int | None = None
    grad_accum: int | None = None
    no_checkpointing: bool = False
    fp32: bool = False
    lora_r: int | None = None
    lora_targets: str | None = None
    load_in_4bit: bool = False
    script: Path | None = None
    script_args: tuple[str, ...] = ()
    time_limit: float | None = None
    gpu: str | None = None
    alloc_conf: str | None = None
    memory_fraction: float | None = None
    margin: float | None = None
    max_batch: bool = False
    max_seq_len: bool = False
    batch_arg: str | None = None
    seq_len_arg: str | None = None
    plan: bool = False
    keep: str | None = None

    @classmethod
    def of(cls, ns: Any) -> EstimateFlags:
        """The flags of a parsed command line (any object with these attributes), the
        ``--`` before a script's arguments dropped."""
        given = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        rest = list(given.get("script_args") or ())
        given["script_args"] = tuple(rest[1:] if rest and rest[0] == "--" else rest)
        return cls(**given)


@dataclass(frozen=True)
class ScriptSubject:
    """A user's training script: run as ``python PATH ARGS`` on fake tensors, stopped at its
    second probe step (or at the request's time limit)."""

    path: Path
    args: tuple[str, ...] = ()
    search_arg: str | None = None  # the script's own option a search sets (``--batch-size``)

    def value(self) -> int | None:
        """The value the script's arguments give :attr:`search_arg` (None: not given)."""
        for i, a in enumerate(self.args):
            if a == self.search_arg and i + 1 < len(self.args):
                given = self.args[i + 1]
            elif self.search_arg and a.startswith(f"{self.search_arg}="):
                given = a.split("=", 1)[1]
            else:
                continue
            try:
                return int(given)
            except ValueError:
                raise EstimateError(
                    f"{self.search_arg} {given}: the script's value is not a whole number"
                ) from None
        return None

    def at(self, v: int) -> ScriptSubject:
        """The script with :attr:`search_arg` set to ``v`` (each time it is given, or added)."""
        assert self.search_arg is not None
        out, i, found = [], 0, False
        while i < len(self.args):
            a = self.args[i]
            if a == self.search_arg and i + 1 < len(self.args):
                out += [a, str(v)]
                i, found = i + 2, True
                continue
            if a.startswith(f"{self.search_arg}="):
                a, found = f"{self.search_arg}={v}", True
            out.append(a)
            i += 1
        if not found:
            out += [self.search_arg, str(v)]
        return replace(self, args=tuple(out))


@dataclass(frozen=True)
class EstimateRequest:
    """A checked estimate: what is estimated, the allocator's settings, the GPU it is held
    against (None: no verdict), the card a script's ``torch.cuda`` counters answer from, and
    the axis searched for its largest value that fits (None: no search), and the seconds one
    trace may take (a script's run to its second probe step, or one trace of a spec; a search
    traces several). ``real``: the script on real CPU tensors instead of fake ones (the tests
    hold the two to each other)."""

    subject: Spec | ScriptSubject
    allocator: AllocatorConfig
    target: fit.Target | None
    counters_card: gpus.Card
    search: str | None = None
    real: bool = False
    time_limit: float = DEFAULT_TIME_LIMIT
    # --plan: the knobs kept as asked, and what the request was planned from (the flags, the
    # --like run's summary, whether this machine has a GPU): a plan is these flags changed
    plan: frozenset[Knob] | None = None
    origin: tuple[EstimateFlags, Any, bool] | None = field(default=None, compare=False)

    @property
    def script(self) -> ScriptSubject | None:
        return self.subject if isinstance(self.subject, ScriptSubject) else None

    @property
    def spec(self) -> Spec | None:
        return self.subject if isinstance(self.subject, Spec) else None

    def to_dict(self) -> dict[str, Any]:
        """The request as JSON data (what a script's child process reads)."""
        s = self.subject
        if isinstance(s, ScriptSubject):
            subject = {"script": str(s.path), "args": list(s.args), "search_arg": s.search_arg}
        else:
            subject = {"spec": {**asdict(s), "lora_targets": list(s.lora_targets)}}
        t = self.target
        return {
            "subject": subject,
            "allocator": {
                **asdict(self.allocator),
                "roundup_power2_divisions": list(self.allocator.roundup_power2_divisions),
            },
            "target": None
            if t is None
            else {"card": t.card.to_dict(), "margin": t.margin, "fraction": t.fraction},
            "counters_card": self.counters_card.to_dict(),
            "search": self.search,
            "real": self.real,
            "time_limit": self.time_limit,
        }

    @classmethod
    def from_dict(cls, d: Any) -> EstimateRequest:
        """A request read back (:class:`EstimateError` for anything malformed)."""
        try:
            s = d["subject"]
            if "script" in s:
                arg = s.get("search_arg")
                subject: Spec | ScriptSubject = ScriptSubject(
                    Path(str(s["script"])),
                    tuple(str(a) for a in s["args"]),
                    None if arg is None else str(arg),
                )
            else:
                spec = dict(s["spec"])
                subject = Spec(**{**spec, "lora_targets": tuple(spec.get("lora_targets") or ())})
            a = dict(d["allocator"])
            allocator = AllocatorConfig(
                **{**a, "roundup_power2_divisions": tuple(a["roundup_power2_divisions"])}
            )
            t = d["target"]
            target = (
                None
                if t is None
                else fit.Target(gpus.Card(**t["card"]), float(t["margin"]), t["fraction"])
            )
            return cls(
                subject,
                allocator,
                target,
                gpus.Card(**d["counters_card"]),
                d.get("search"),
                bool(d.get("real", False)),
                float(d.get("time_limit", DEFAULT_TIME_LIMIT)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EstimateError(f"an estimate request that cannot be read ({exc})") from None


def plan_estimate(
    flags: EstimateFlags, cuda: bool, like: Any = None, *, real: bool = False
) -> EstimateRequest:
    """The request ``flags`` describe on this machine (``cuda``: it has a GPU torch can use;
    ``like``: the workload summary of the run ``--like`` names, as data). Every check is here:
    :class:`EstimateError`, one line, before anything runs."""
    allocator = _allocator(flags.alloc_conf)
    limit = DEFAULT_TIME_LIMIT if flags.time_limit is None else flags.time_limit
    if not (math.isfinite(limit) and 0 < limit <= MAX_TIME_LIMIT):
        raise EstimateError(f"--time-limit {limit:g}: seconds, above 0 and at most a week")
    if flags.script is not None:
        subject: Spec | ScriptSubject = _script(flags)
    else:
        if flags.script_args:
            raise EstimateError("arguments after '--' are for --script")
        for _s, _f, key, arg_flag, _e in _SEARCH_ARGS:
            if getattr(flags, key):
                raise EstimateError(f"{arg_flag} is for --script (a config's search sets its own)")
        subject = _spec(flags, cuda, like)
    target, counters = _target(flags, cuda)
    search = "batch" if flags.max_batch else "seq_len" if flags.max_seq_len else None
    if search is not None and target is None:
        flag = "--max-batch" if flags.max_batch else "--max-seq-len"
        raise EstimateError(f"{flag} needs --gpu NAME|GIB (this machine has no GPU)")
    return EstimateRequest(
        subject,
        allocator,
        target,
        counters,
        search,
        real,
        float(limit),
        _kept(flags, search, target),
        (flags, like, cuda),
    )


def _kept(flags: EstimateFlags, search: str | None, target: Any) -> frozenset[Knob] | None:
    """``--plan``'s knobs kept as asked (``--keep optim,seq_len``: the knobs of those names,
    ``optim`` for both 8-bit optimizers, ``lora`` for LoRA and QLoRA); None: no plan asked."""
    if not flags.plan:
        if flags.keep:
            raise EstimateError("--keep is for --plan")
        return None
    if search is not None:
        raise EstimateError("--plan searches its own micro-batch: drop --max-batch/--max-seq-len")
    if target is None:
        raise EstimateError("--plan needs --gpu NAME|GIB (this machine has no GPU)")
    if flags.script is not None:
        raise EstimateError(
            "--plan is for --size, --config and --like: a script's settings are its own "
            "(--alloc-conf and --max-batch --batch-arg NAME reach them)"
        )
    kept: set[Knob] = set()
    groups = {"optim": (Knob.OPTIMIZER_8BIT, Knob.PAGED_8BIT), "lora": (Knob.LORA, Knob.QLORA)}
    for name in filter(None, (n.strip() for n in (flags.keep or "").split(","))):
        if name not in KNOBS and name not in groups:
            raise EstimateError(f"--keep {inert(name)[:40]}: one of {', '.join((*KNOBS, *groups))}")
        kept.update(groups.get(name) or (Knob(name),))
    return frozenset(kept)


# what a script sets itself: flags --script refuses
_SCRIPT_DECIDES = (
    ("workload", "--workload"),
    ("shard", "--shard"),
    ("world_size", "--world-size"),
    ("optim", "--optim"),
    ("seq_len", "--seq-len"),
    ("batch", "--batch"),
    ("grad_accum", "--grad-accum"),
    ("no_checkpointing", "--no-checkpointing"),
    ("fp32", "--fp32"),
    ("lora_r", "--lora-r"),
    ("lora_targets", "--lora-targets"),
    ("load_in_4bit", "--load-in-4bit"),
)


def _script(flags: EstimateFlags) -> ScriptSubject:
    given = [flag for key, flag in _SCRIPT_DECIDES if getattr(flags, key) not in (None, False)]
    if given:
        raise EstimateError(
            "--script takes the model, optimizer and batch from the script; "
            f"drop {', '.join(given)}"
        )
    path = Path(flags.script).resolve()
    if not path.is_file():
        raise EstimateError(f"--script {flags.script}: no such file")
    subject = ScriptSubject(path, tuple(flags.script_args), _search_arg(flags))
    if subject.search_arg is not None:
        v = subject.value()
        if v is not None and v < 1:
            raise EstimateError(f"{subject.search_arg} {v}: the search starts from 1 or more")
    return subject


# a search of a script: the flag that asks for it, and the flag naming the script's option
_SEARCH_ARGS = (("max_batch", "--max-batch", "batch_arg", "--batch-arg", "batch_size"),)
_SEARCH_ARGS += (("max_seq_len", "--max-seq-len", "seq_len_arg", "--seq-len-arg", "seq_len"),)


def _search_arg(flags: EstimateFlags) -> str | None:
    """The script's own option a ``--max-*`` search sets (``--batch-arg batch_size``: the
    script's ``--batch_size``), checked: each needs the other."""
    for search, search_flag, key, arg_flag, example in _SEARCH_ARGS:
        name = getattr(flags, key)
        if getattr(flags, search) and not name:
            raise EstimateError(
                f"{search_flag} with --script needs {arg_flag} NAME: the script's own option "
                f"the search sets (e.g. {arg_flag} {example} for its --{example})"
            )
        if name and not getattr(flags, search):
            raise EstimateError(f"{arg_flag} is for {search_flag} with --script")
        if name:
            opt = name if name.startswith("-") else f"--{name}"
            if not re.fullmatch(r"--?[A-Za-z0-9][\w.-]*", opt):
                raise EstimateError(f"{arg_flag} {inert(name)[:80]}: an option's name (batch_size)")
            return opt
    return None


def _spec(flags: EstimateFlags, cuda: bool, like: Any) -> Spec:
    """The spec the flags describe, on this machine (its defaults: :meth:`Spec.for_machine`)."""
    workload = flags.workload or DEFAULT_WORKLOAD
    dist = workload == "distributed"
    if not dist and (flags.world_size or 1) != 1 and flags.shard != "fsdp2":
        raise EstimateError(
            "--world-size with the finetune workload needs --shard fsdp2 (the HF Trainer's "
            "step under FSDP2), or --workload distributed"
        )
    given: dict[str, Any] = dict(
        optim=flags.optim,
        seq_len=flags.seq_len,
        batch=flags.batch,
        grad_accum=flags.grad_accum,
        size=flags.size,
        config=read_config(flags.config) if flags.config is not None else None,
        bf16=False if flags.fp32 else None,
        checkpointing=False if flags.no_checkpointing else None,
        lora_r=flags.lora_r,
        lora_targets=tuple(t.strip() for t in flags.lora_targets.split(",") if t.strip())
        if flags.lora_targets
        else None,
        load_in_4bit=True if flags.load_in_4bit else None,
    )
    given.update(shard=flags.shard, world_size=flags.world_size)
    spec = Spec.for_machine(cuda, workload, **given)
    if spec.config is not None:
        spec = _quantised(spec, flags)
    if flags.like is not None:  # the run's model and batch; what the flags name wins
        spec = spec.like(like, str(flags.like))
        named = {
            k: getattr(flags, k)
            for k in ("optim", "seq_len", "batch", "grad_accum")
            if getattr(flags, k)
        }
        spec = replace(spec, **named)
    spec.validate()
    return spec


def _quantised(spec: Spec, flags: EstimateFlags) -> Spec:
    """A config's ``quantization_config`` (every pre-quantised checkpoint has one) honoured:
    bitsandbytes 4-bit is the 4-bit base ``--load-in-4bit`` builds (it trains adapters only:
    ``--lora-r`` needed); what stepmem does not model — 8-bit weights, GPTQ, AWQ, … — is
    refused by name rather than estimated as a full-precision model."""
    q = (spec.config or {}).get("quantization_config")
    if q is None:
        return spec
    q = q if isinstance(q, dict) else {}
    method = str(q.get("quant_method", "?"))
    if method == "bitsandbytes" and q.get("load_in_4bit"):
        if not spec.lora_r:
            raise EstimateError(
                "--config: its quantization_config loads the base in 4 bits, which trains "
                "adapters only: add --lora-r R (QLoRA)"
            )
        return replace(spec, load_in_4bit=True)
    what = "8-bit weights (bitsandbytes' Linear8bitLt)" if q.get("load_in_8bit") else method
    raise EstimateError(
        f"--config: its quantization_config ({inert(what)[:60]}) is not modelled; bitsandbytes "
        "4-bit is (a full-precision estimate of it would not be the model you load)"
    )


def _target(flags: EstimateFlags, cuda: bool) -> tuple[fit.Target | None, gpus.Card]:
    """The GPU held against (``--gpu``, else this machine's; None without either) with the
    margin and memory fraction, and the card a script's counters answer from."""
    margin = (DEFAULT_MARGIN if flags.margin is None else flags.margin) / 100
    fit.check(margin, flags.memory_fraction)
    if flags.gpu is not None:
        card = gpus.card(flags.gpu)
    elif cuda:
        card = gpus.local_card()
    else:
        if flags.memory_fraction is not None:
            raise EstimateError("--memory-fraction needs --gpu NAME|GIB (this machine has no GPU)")
        return None, gpus.card(COUNTERS_CARD)
    return fit.Target(card, margin, flags.memory_fraction), card


def _allocator(conf: str | None) -> AllocatorConfig:
    if conf is None:
        return AllocatorConfig.from_env()
    try:
        return AllocatorConfig.parse(conf, "--alloc-conf")
    except EstimateError as exc:
        raise EstimateError(f"--alloc-conf {conf}: {exc}") from None
