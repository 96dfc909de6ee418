"""The NVML funnel and live GPU devices.

Every NVML call in stepmem goes through :func:`call` (or, on the sampling hot path, through a
reader that :func:`call` resolved once). The funnel

* initialises NVML once per process, lazily, and never shuts it down per sample;
* maps ``pynvml.NVMLError`` codes to a small set of typed exceptions (:class:`NvmlError` and its
  subclasses), each with a ``kind`` string used as the ``kind`` label of
  ``stepmem_sampler_errors_total``;
* counts every error by kind in :data:`ERROR_COUNTS` (process-wide; samplers keep their own
  per-device counts too).

Devices are found and held **by UUID**. NVML indices, CUDA indices (after
``CUDA_VISIBLE_DEVICES``) and Ray's GPU ids number the same GPU differently; the UUID is the only
name all three agree on.

Memory figures (bytes):

* **v2** (``nvmlDeviceGetMemoryInfo_v2``): ``used`` excludes the driver-reserved memory, which is
  reported apart as ``reserved`` (about 615 MiB on an H200 with driver 580);
  ``total = used + reserved + free``.
* **v1** (fallback where v2 is not supported): ``used`` *includes* the driver-reserved memory and
  ``reserved`` is reported as 0. :attr:`LiveDevice.memory_info_version` records which one a device
  uses, so readings from both are never mixed silently.

Cost: one v2 read through the preresolved reader is a single ctypes call into
``libnvidia-ml`` (5.5 µs in C on an H200, ≈8 µs from Python).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from collector.model.errors import StepmemError
from collector.model.records import DeviceInfo, MemoryInfo, ProcessMemory

__all__ = [
    "ERROR_COUNTS",
    "LiveBackend",
    "LiveDevice",
    "NvmlError",
    "NvmlGpuLost",
    "NvmlNotFound",
    "NvmlNotSupported",
    "NvmlUnavailable",
    "NvmlUnknown",
    "call",
    "map_error",
    "open_reader",
]

log = logging.getLogger(__name__)


class NvmlError(StepmemError, RuntimeError):
    """An NVML call failed (for the command, a user's problem: no driver, no such GPU).
    ``kind`` names the failure for counting; ``code`` is NVML's."""

    kind = "unknown"

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class NvmlNotSupported(NvmlError):
    """The device or driver does not support this query."""

    kind = "not_supported"


class NvmlGpuLost(NvmlError):
    """The GPU fell off the bus or needs a reset: readings from it stop."""

    kind = "gpu_lost"


class NvmlNotFound(NvmlError):
    """No device with this UUID (or index) exists on this node."""

    kind = "not_found"


class NvmlUnavailable(NvmlError):
    """NVML itself cannot be used here: no library, no driver, no permission."""

    kind = "unavailable"


class NvmlUnknown(NvmlError):
    """Any other NVML error (``NVML_ERROR_UNKNOWN``, timeouts, ...)."""

    kind = "unknown"


ERROR_COUNTS: Counter[str] = Counter()
_count_lock = threading.Lock()
_init_lock = threading.Lock()
_initialised = False
_missing_logged: set[str] = set()


def _pynvml() -> Any:
    import pynvml

    return pynvml


def map_error(code: int, where: str = "") -> NvmlError:
    """Turn an NVML return code into the typed exception for it (not raised, not counted)."""
    nv = _pynvml()
    text = f"{where}: " if where else ""
    try:
        text += str(nv.NVMLError(code))
    except Exception:  # an unknown code must still map
        text += f"NVML error {code}"
    if code in (
        nv.NVML_ERROR_NOT_SUPPORTED,
        nv.NVML_ERROR_FUNCTION_NOT_FOUND,
        nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    ):
        cls: type[NvmlError] = NvmlNotSupported
    elif code in (nv.NVML_ERROR_GPU_IS_LOST, nv.NVML_ERROR_RESET_REQUIRED):
        cls = NvmlGpuLost
    elif code in (nv.NVML_ERROR_NOT_FOUND, nv.NVML_ERROR_INVALID_ARGUMENT):
        cls = NvmlNotFound
    elif code in (
        nv.NVML_ERROR_LIBRARY_NOT_FOUND,
        nv.NVML_ERROR_DRIVER_NOT_LOADED,
        nv.NVML_ERROR_NO_PERMISSION,
        nv.NVML_ERROR_UNINITIALIZED,
        nv.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    ):
        cls = NvmlUnavailable
    else:
        cls = NvmlUnknown
    return cls(text, code)


def _count(err: NvmlError) -> NvmlError:
    with _count_lock:
        ERROR_COUNTS[err.kind] += 1
    return err


def _ensure_init() -> None:
    global _initialised
    if _initialised:
        return
    with _init_lock:
        if _initialised:
            return
        try:
            nv = _pynvml()
        except ImportError as exc:  # nvidia-ml-py is a dependency; guard for broken installs
            raise _count(NvmlUnavailable(f"pynvml cannot be imported: {exc}")) from exc
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            raise _count(map_error(exc.value, "nvmlInit")) from exc
        _initialised = True


def call(name: str, *args: Any) -> Any:
    """Call ``pynvml.<name>(*args)`` through the funnel.

    Raises the typed :class:`NvmlError` subclass for the failure, after counting it. A function
    missing from the installed library is logged once and raised as :class:`NvmlNotSupported`.
    """
    nv = _pynvml()
    fn = getattr(nv, name, None)
    if fn is None:
        if name not in _missing_logged:
            _missing_logged.add(name)
            log.warning("pynvml has no %s; treating it as not supported", name)
        raise _count(NvmlNotSupported(f"{name}: missing from pynvml"))
    _ensure_init()
    try:
        return fn(*args)
    except nv.NVMLError as exc:
        err = map_error(exc.value, name)
        if isinstance(err, NvmlNotSupported) and name not in _missing_logged:
            _missing_logged.add(name)
            log.info("%s is not supported here", name)
        raise _count(err) from exc


def _function_pointer(name: str) -> Any:
    _ensure_init()
    nv = _pynvml()
    try:
        return nv._nvmlGetFunctionPointer(name)
    except nv.NVMLError as exc:
        raise _count(map_error(exc.value, name)) from exc


class _MemoryReader:
    """Preresolved ``nvmlDeviceGetMemoryInfo{,_v2}`` for one handle: the sampler's hot path.

    pynvml's own wrapper allocates a struct and looks the function up on every call; this keeps
    one struct and one function pointer, and still maps errors through the funnel.
    """

    def __init__(
        self, handle: Any, version: int, resolve: Callable[[str], Any] | None = None
    ) -> None:
        nv = _pynvml()
        resolve = resolve or _function_pointer
        self.version = version
        self._handle = handle
        if version == 2:
            self._struct = nv.c_nvmlMemory_v2_t()
            self._struct_version = nv.nvmlMemory_v2
            self._fn = resolve("nvmlDeviceGetMemoryInfo_v2")
        else:
            self._struct = nv.c_nvmlMemory_t()
            self._fn = resolve("nvmlDeviceGetMemoryInfo")
        self._ref = ctypes.byref(self._struct)

    def read(self) -> tuple[int, int]:
        """``(used, reserved)`` in bytes. ``reserved`` is 0 under v1."""
        s = self._struct
        if self.version == 2:
            s.version = self._struct_version
            ret = self._fn(self._handle, self._ref)
            if ret:
                raise _count(map_error(ret, "nvmlDeviceGetMemoryInfo_v2"))
            return s.used, s.reserved
        ret = self._fn(self._handle, self._ref)
        if ret:
            raise _count(map_error(ret, "nvmlDeviceGetMemoryInfo"))
        return s.used, 0

    def memory(self) -> MemoryInfo:
        used, reserved = self.read()
        s = self._struct
        return MemoryInfo(
            total=s.total, free=s.free, used=used, reserved=reserved, version=self.version
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class LiveDevice:
    """One physical GPU, opened by UUID. ``index`` is NVML's index, kept for labels only."""

    info: DeviceInfo
    _reader: _MemoryReader
    _handle: Any

    backend = "nvml"

    @property
    def uuid(self) -> str:
        return self.info.uuid

    @property
    def memory_info_version(self) -> int:
        return self._reader.version

    def read(self) -> tuple[int, int]:
        """``(used, reserved)`` bytes from one NVML call; raises :class:`NvmlError`."""
        return self._reader.read()

    def memory(self) -> MemoryInfo:
        return self._reader.memory()

    def processes(self) -> list[ProcessMemory]:
        """Per-process used memory (compute processes). NVML's per-process figure does not count
        CUDA managed memory resident on the device; the device figure does."""
        procs = call("nvmlDeviceGetComputeRunningProcesses", self._handle)
        return [
            ProcessMemory(pid=int(p.pid), used_bytes=p.usedGpuMemory, name=process_name(p.pid))
            for p in procs
        ]

    def processes_reading(self, t_ns: int) -> tuple[int, int, list[ProcessMemory]]:
        """Per-process memory with the device's used memory at the same moment, and when:
        now (live NVML cannot read the past; ``t_ns``, the moment wanted, is a replay's)."""
        procs = self.processes()
        used, _ = self.read()
        return time.monotonic_ns(), used, procs


def process_name(pid: int, limit: int = 80) -> str:
    """What a process on the GPU is, for the report: for this user's own processes the command
    line from ``/proc`` (``python -m workloads.patterns ...``), shortened to ``limit``
    characters; for another user's only its program name and owner (``python3 (uid 1001)``):
    their arguments may hold anything and are not stepmem's to keep. Empty when it cannot be
    read (another PID namespace, gone)."""
    import os

    try:
        owner = os.stat(f"/proc/{int(pid)}").st_uid
        if owner != os.getuid():
            with open(f"/proc/{int(pid)}/comm", "rb") as f:
                comm = f.read().decode(errors="replace").strip()
            return f"{comm} (uid {owner})"[:limit]
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return ""
    words = [a.decode(errors="replace") for a in args if a]
    if words:
        words[0] = words[0].rsplit("/", 1)[-1]
    return " ".join(" ".join(words).split())[:limit]  # one line: `python -c` code has newlines


def open_reader(handle: Any, resolve: Callable[[str], Any] | None = None) -> _MemoryReader:
    """The v2 reader when the driver answers it, else v1 (the version is kept on the reader).

    ``resolve(name)`` gives the C function for a symbol (default: libnvidia-ml's, through the
    funnel); tests pass their own. A driver without the ``_v2`` symbol, or one answering
    not-supported or a version mismatch, gets v1.
    """
    try:
        reader = _MemoryReader(handle, 2, resolve)
        reader.read()
        return reader
    except NvmlNotSupported:
        log.info(
            "nvmlDeviceGetMemoryInfo_v2 not supported: falling back to v1 "
            "('used' then includes driver-reserved memory)"
        )
        return _MemoryReader(handle, 1, resolve)


class LiveBackend:
    """NVML on this node."""

    name = "nvml"

    def devices(self) -> list[DeviceInfo]:
        """Every GPU NVML sees on this node, whatever ``CUDA_VISIBLE_DEVICES`` says."""
        out = []
        for index in range(call("nvmlDeviceGetCount")):
            handle = call("nvmlDeviceGetHandleByIndex", index)
            out.append(self._info(handle, index))
        return out

    def _info(self, handle: Any, index: int) -> DeviceInfo:
        mem = call("nvmlDeviceGetMemoryInfo", handle)
        try:
            driver = _text(call("nvmlSystemGetDriverVersion"))
        except NvmlError:
            driver = ""
        return DeviceInfo(
            uuid=_text(call("nvmlDeviceGetUUID", handle)),
            index=index,
            name=_text(call("nvmlDeviceGetName", handle)),
            total_bytes=int(mem.total),
            driver=driver,
        )

    def open(self, uuid: str) -> LiveDevice:
        """Open the GPU with this UUID. Raises :class:`NvmlNotFound` when this node has none."""
        try:
            handle = call("nvmlDeviceGetHandleByUUID", uuid)
        except NvmlNotFound as exc:
            raise NvmlNotFound(f"no GPU with UUID {uuid} on this node") from exc
        index = int(call("nvmlDeviceGetIndex", handle))
        return LiveDevice(
            info=self._info(handle, index), _reader=open_reader(handle), _handle=handle
        )
