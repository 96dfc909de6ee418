"""Prometheus remote write: every step record pushed with its own step-end timestamp.

Wire format (Prometheus remote-write 1.0): a protobuf ``WriteRequest`` compressed with snappy's
**block** format (``cramjam.snappy.compress_raw``; the *framed* format, which some snappy APIs
produce by default, is rejected by Prometheus), POSTed with ``Content-Encoding: snappy``,
``Content-Type: application/x-protobuf`` and ``X-Prometheus-Remote-Write-Version: 0.1.0``. The
message has three tiny types, so it is encoded here by hand (:mod:`collector.export.wire`) rather
than through generated protobuf code and a ``protoc`` step.

Behaviour: :meth:`RemoteWriter.push_step` only appends to a bounded buffer (oldest samples are
dropped and counted when it is full); a daemon thread sends batches off the sampling and join
threads. 5xx answers, 429 (too many requests) and connection errors are retried with exponential
backoff, keeping the batch; a ``Retry-After`` header (seconds or an HTTP date) sets the wait, up to
``RETRY_AFTER_MAX_S``. Other 4xx answers are logged with Prometheus' reason and dropped
(counted), never retried — one bad sample rejects a whole request. :meth:`RemoteWriter.mark_stale`
(called when a run's sampler stops) ends every series it pushed with Prometheus' stale marker, so
a finished run's last values do not linger in queries for the 5-minute lookback.

Within a series timestamps must increase: a step ending in the same millisecond as the previous
one is moved 1 ms later (counted as ``shifted``).

Credentials come from a file or an environment variable named in the config, are read when the
writer starts, and never appear in logs, metrics, ``repr`` or the run store. A URL that carries
credentials itself (``http://user:pass@host/``) is refused: they would be stored with the run's
command line. Redirects are never followed: a 3xx answer is an error (counted as
``redirected``, not retried), so neither the samples nor the ``Authorization`` header go to
another host, and nothing is counted as sent that was not accepted.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cramjam

from collector.export.wire import Series, encode_write_request
from collector.metrics import PUSH_JOB, PUSH_SAMPLES_JOB
from collector.model.errors import InputError
from collector.model.series import step_values
from collector.model.step import StepRecord
from collector.model.untrusted import inert

RETRY_AFTER_MAX_S = 60.0


def _user_agent() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"stepmem/{version('stepmem')}"
    except PackageNotFoundError:
        return "stepmem"


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date), capped at
    ``RETRY_AFTER_MAX_S``; None when absent or unreadable."""
    import email.utils

    if not value:
        return None
    value = value.strip()
    try:
        wait = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        wait = when - (time.time() if now is None else now)
    if not math.isfinite(wait):  # "nan", "inf": unreadable, like a missing header
        return None
    return min(max(wait, 0.0), RETRY_AFTER_MAX_S)


__all__ = ["RemoteWriteConfig", "RemoteWriter", "encode_write_request", "redact_url"]


def redact_url(url: str) -> str:
    """``url`` with what may be a secret left out: user info and query values
    (``http://127.0.0.1:9090/api/v1/write?api_key=<redacted>``)."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unreadable URL>"
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = urlencode([(k, "<redacted>") for k, _ in parse_qsl(parts.query, True)], safe="<>")
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Never follow a redirect: the 3xx comes back as an HTTPError."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


log = logging.getLogger(__name__)


@dataclass
class RemoteWriteConfig:
    """Where and how to push. Secrets are named (file or environment variable), never inlined."""

    url: str
    bearer_token_file: str | None = None
    bearer_token_env: str | None = None
    basic_user: str | None = None
    basic_password_file: str | None = None
    basic_password_env: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure_skip_verify: bool = False
    timeout_s: float = 5.0
    batch_max: int = 5000
    buffer_max: int = 200_000
    flush_interval_s: float = 1.0
    backoff_min_s: float = 0.2
    backoff_max_s: float = 10.0
    job: str = PUSH_JOB

    def __post_init__(self) -> None:
        from urllib.parse import urlsplit

        if not self.url.startswith(("http://", "https://")):
            raise InputError(
                f"remote-write URL must be http:// or https://, got {redact_url(self.url)!r}"
            )
        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError as exc:
            raise InputError(
                f"remote-write URL {redact_url(self.url)!r} is not a URL ({exc})"
            ) from None
        if parts.username is not None or parts.password is not None:
            raise InputError(
                "remote-write URL holds credentials (user:password@); give them with "
                "--remote-write-basic-user and --remote-write-basic-password-env (or -file), "
                "which are never stored"
            )
        if not parts.hostname:
            raise InputError(f"remote-write URL {redact_url(self.url)!r} names no host")
        if self.buffer_max < 1 or self.batch_max < 1:
            raise InputError("remote-write buffer and batch sizes must be >= 1")
        if (self.bearer_token_file or self.bearer_token_env) and self.basic_user:
            raise InputError("choose bearer-token or basic auth for remote write, not both")

    def authorization(self) -> str | None:
        """The ``Authorization`` header value, read now from the named file or variable."""

        def secret(path: str | None, env: str | None, what: str) -> str:
            if path:
                try:
                    return Path(path).read_text().strip()
                except (OSError, UnicodeDecodeError) as exc:
                    raise InputError(f"remote write: {what} file {path}: {exc}") from None
            if env:
                value = os.environ.get(env)
                if value is None:
                    raise InputError(f"remote write: environment variable {env} ({what}) unset")
                return value.strip()
            raise InputError(f"remote write: no {what} source given")

        if self.bearer_token_file or self.bearer_token_env:
            return "Bearer " + secret(self.bearer_token_file, self.bearer_token_env, "token")
        if self.basic_user:
            pw = secret(self.basic_password_file, self.basic_password_env, "password")
            return "Basic " + base64.b64encode(f"{self.basic_user}:{pw}".encode()).decode()
        return None

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https://"):
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise InputError(f"remote write: TLS files: {exc}") from None
        if self.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


class RemoteWriter:
    """Buffers samples and sends them from a daemon thread. Never blocks its callers."""

    def __init__(self, config: RemoteWriteConfig) -> None:
        self.config = config
        self.sent = 0
        self.requests = 0
        self.dropped: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()  # requests that failed in an unexpected way
        self.shifted = 0
        self.throttled = 0  # 429 answers
        self.last_error = ""
        self._auth = config.authorization()
        self._ssl = config.ssl_context()
        handlers: list[Any] = [_NoRedirect()]
        if self._ssl is not None:
            handlers.append(urllib.request.HTTPSHandler(context=self._ssl))
        self._opener = urllib.request.build_opener(*handlers)
        self._buf: deque[tuple[Series, int, float]] = deque()
        self._last_ts: dict[Series, int] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._retrying = False
        self._retry_after: float | None = None  # the receiver's Retry-After, for the next wait
        self._warned_redirect = False
        self._user_agent = _user_agent()
        self._thread = threading.Thread(target=self._run, name="stepmem-remote-write", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:  # never show the Authorization value, nor a URL's query
        return (
            f"RemoteWriter(url={redact_url(self.config.url)!r}, sent={self.sent}, "
            f"pending={len(self._buf)})"
        )

    def push(
        self, name: str, labels: dict[str, str], t_ms: int, value: float, job: str | None = None
    ) -> None:
        """Queue one sample (never blocks). ``job`` overrides the config's job label."""
        key: Series = tuple(
            sorted({**labels, "__name__": name, "job": job or self.config.job}.items())
        )
        with self._lock:
            last = self._last_ts.get(key)
            if last is not None and t_ms <= last:
                t_ms = last + 1
                self.shifted += 1
            self._last_ts[key] = t_ms
            if len(self._buf) >= self.config.buffer_max:
                self._buf.popleft()
                self.dropped["buffer_full"] += 1
            self._buf.append((key, t_ms, value))
            full = len(self._buf) >= self.config.batch_max
        if full and not self._retrying:  # during backoff, wait it out
            self._wake.set()

    def push_step(self, labels: dict[str, str], rec: StepRecord, wall_offset_ns: int) -> None:
        """Every pushed per-step value of ``rec`` (:data:`collector.model.series.SERIES`) at its
        step-end time (monotonic + ``wall_offset_ns``)."""
        t_ms = (rec.end_ns + wall_offset_ns) // 1_000_000
        for name, extra, value in step_values(rec, pushed_only=True):
            self.push(name, {**labels, **extra}, t_ms, float(value))

    def push_samples(
        self, labels: dict[str, str], t_ns: Any, used: Any, wall_offset_ns: int, final: bool = False
    ) -> int:
        """Raw NVML samples as per-millisecond maxima (remote write has millisecond resolution
        and rejects two samples of one series in one millisecond). Unless ``final``, the last
        millisecond is held back — more samples may still land in it — and the number of samples
        held back is returned so the caller can offer them again."""
        import numpy as np

        if len(t_ns) == 0:
            return 0
        t_ms = (np.asarray(t_ns) + wall_offset_ns) // 1_000_000
        starts = np.concatenate(([0], np.flatnonzero(np.diff(t_ms)) + 1))
        maxima = np.maximum.reduceat(np.asarray(used), starts)
        held = 0 if final else len(t_ms) - int(starts[-1])
        groups = len(starts) if final else len(starts) - 1
        for k in range(groups):
            self.push(
                "stepmem_nvml_used_bytes",
                labels,
                int(t_ms[starts[k]]),
                float(maxima[k]),
                job=PUSH_SAMPLES_JOB,
            )
        return held

    def stats(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "pending": len(self._buf),
            "dropped": dict(self.dropped),
            "requests": self.requests,
            "shifted": self.shifted,
            "throttled": self.throttled,
            "last_error": self.last_error,
            "errors": dict(self.errors),
        }

    def mark_stale(self, t_ms: int | None = None) -> int:
        """Queue Prometheus' stale marker for every series pushed so far, at ``t_ms`` (default
        now; always after the series' last sample). Returns how many series were marked."""
        now = int(time.time() * 1000) if t_ms is None else t_ms
        with self._lock:
            keys = list(self._last_ts.items())
        for key, last in keys:
            labels = dict(key)
            name, job = labels.pop("__name__"), labels.pop("job")
            self.push(name, labels, max(now, last + 1), float("nan"), job=job)
        return len(keys)

    def _take(self) -> list[tuple[Series, int, float]]:
        with self._lock:
            n = min(len(self._buf), self.config.batch_max)
            return [self._buf.popleft() for _ in range(n)]

    def _put_back(self, batch: list[tuple[Series, int, float]]) -> None:
        with self._lock:
            room = self.config.buffer_max - len(self._buf)
            if room < len(batch):  # keep the newest of the failed batch that still fits
                self.dropped["buffer_full"] += len(batch) - max(room, 0)
                batch = batch[len(batch) - max(room, 0) :]
            self._buf.extendleft(reversed(batch))

    def _post(self, body: bytes) -> int:
        headers = {
            "Content-Encoding": "snappy",
            "Content-Type": "application/x-protobuf",
            "X-Prometheus-Remote-Write-Version": "0.1.0",
            "User-Agent": self._user_agent,
        }
        if self._auth:
            headers["Authorization"] = self._auth
        req = urllib.request.Request(self.config.url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(req, timeout=self.config.timeout_s) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            reason = inert(exc.read(500).decode(errors="replace").strip())  # the receiver's words
            self.last_error = f"HTTP {exc.code}: {reason}"
            self._retry_after = retry_after_s(exc.headers.get("Retry-After"))
            return exc.code

    def send_once(self) -> bool:
        """Send one batch. Returns False when it should be retried later (5xx, no connection)."""
        batch = self._take()
        if not batch:
            return True
        series: dict[Series, list[tuple[int, float]]] = {}
        for key, t_ms, value in batch:
            series.setdefault(key, []).append((t_ms, value))
        body = cramjam.snappy.compress_raw(encode_write_request(series))
        try:
            status = self._post(bytes(body))
        except (urllib.error.URLError, OSError) as exc:
            self.last_error = f"connection: {getattr(exc, 'reason', exc)}"
            self._put_back(batch)
            return False
        except Exception as exc:  # not HTTP at the other end (BadStatusLine, LineTooLong, …)
            self.last_error = f"not an HTTP answer: {type(exc).__name__}: {inert(str(exc), 120)}"
            self.errors["not_http"] += 1
            self._put_back(batch)
            return False
        self.requests += 1
        if 200 <= status < 300:
            self.sent += len(batch)
            return True
        if status == 429:  # too many requests: keep the batch, wait as asked
            self.throttled += 1
            self._put_back(batch)
            return False
        if 300 <= status < 400:  # never followed: the samples would not arrive (nor stay ours)
            self.dropped["redirected"] += len(batch)
            if not self._warned_redirect:
                self._warned_redirect = True
                log.warning(
                    "remote write answered %s (a redirect, %s): not followed, %d samples dropped;"
                    " give the receiver's final URL",
                    status,
                    self.last_error,
                    len(batch),
                )
            return True
        if 400 <= status < 500:
            self.dropped["rejected_4xx"] += len(batch)
            log.warning(
                "remote write rejected %d samples, not retried: %s", len(batch), self.last_error
            )
            return True
        self._put_back(batch)
        return False

    def _run(self) -> None:
        backoff = 0.0
        while True:
            self._wake.wait(backoff or self.config.flush_interval_s)
            self._wake.clear()
            ok = True
            try:
                while ok and self._buf:
                    ok = self.send_once()
            except Exception as exc:  # never ends the writer: counted, retried after a backoff
                self.errors[type(exc).__name__] += 1
                self.last_error = f"{type(exc).__name__}: {str(exc)[:120]}"
                ok = False
            self._retrying = not ok
            if ok:
                backoff = 0.0
            elif self._retry_after is not None:
                backoff, self._retry_after = max(self._retry_after, 0.01), None
            else:
                backoff = min(
                    max(backoff * 2, self.config.backoff_min_s), self.config.backoff_max_s
                )
                log.info("remote write failed (%s); retrying in %.1f s", self.last_error, backoff)
            if self._closed:
                return

    def close(self, timeout: float = 5.0) -> None:
        """Send what is buffered (bounded by ``timeout``), then stop."""
        deadline = time.monotonic() + timeout
        self._closed = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        try:
            while self._buf and time.monotonic() < deadline:
                if not self.send_once():
                    break
        except Exception as exc:
            self.errors[type(exc).__name__] += 1
        with self._lock:  # what was not sent is counted once, as given up, and let go
            if self._buf:
                self.dropped["gave_up"] += len(self._buf)
                self._buf.clear()
