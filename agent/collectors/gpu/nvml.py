"""The one module that talks to NVML.

Everything else in the agent goes through :class:`Nvml`, which takes the NVML module as a parameter
(``pynvml`` from nvidia-ml-py by default, a fake in tests) and imports it only when first used, so
the agent starts on machines without the package, the driver or a GPU.

Error model (after nvitop): a field the GPU or driver cannot give is N/A (``NA``, a NaN that
poisons arithmetic instead of raising), a missing library or driver is :class:`NvmlUnavailable`
with a one-line ``ERROR ... HINT ...`` message, and a GPU that fell off the bus is :class:`GpuLost`
so the caller can drop that one GPU and carry on with the others.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

NA = float("nan")

# NVML's C enums are a stable ABI; the wrapper passes these values to the module it was given so
# that a fake only needs the same numbers, not a copy of pynvml's constant table.
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_NO_DATA = 21
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_NVLINK_MAX_LINKS = 18  # Hopper/Blackwell have 18; asking for more just returns N/A
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138  # cumulative KiB, scoped per link
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197  # cumulative bytes (may wrap), newer drivers only
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
NVML_MEMORY_V2 = 0x02000028  # nvmlMemory_v2: "used" without the driver's reserved memory, as nvidia-smi

EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID_CRITICAL = 0x8

# Errors that mean "this value is not available here", never "something is broken".
_NA_ERRORS = frozenset(
    {
        NVML_ERROR_NOT_SUPPORTED,
        NVML_ERROR_NO_PERMISSION,
        NVML_ERROR_NOT_FOUND,
        NVML_ERROR_INVALID_ARGUMENT,
        NVML_ERROR_FUNCTION_NOT_FOUND,
        NVML_ERROR_NO_DATA,
        NVML_ERROR_DEPRECATED,
        NVML_ERROR_NOT_READY,
        NVML_ERROR_CORRUPTED_INFOROM,
        NVML_ERROR_UNKNOWN,
    }
)
_LOST_ERRORS = frozenset({NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED, NVML_ERROR_GPU_NOT_FOUND})

_HINTS = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "install the NVIDIA driver (libnvidia-ml.so.1), or in a container run "
    "with the NVIDIA container toolkit (--gpus all)",
    NVML_ERROR_DRIVER_NOT_LOADED: "load the nvidia kernel module (check `nvidia-smi`)",
    NVML_ERROR_NO_PERMISSION: "run the agent as a user that can open /dev/nvidia*",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "the driver was upgraded under a running system: reboot or "
    "reload the nvidia kernel module",
}


class NvmlError(RuntimeError):
    """Base of the wrapper's typed errors."""


class NvmlUnavailable(NvmlError):
    """NVML cannot be used on this machine; ``str()`` is one ``ERROR ... HINT ...`` line."""

    def __init__(self, reason: str, hint: str = "the GPU collector stays off; the agent runs on") -> None:
        super().__init__(f"ERROR NVML unavailable: {reason}. HINT {hint}")
        self.reason = reason
        self.hint = hint


class GpuLost(NvmlError):
    """The GPU stopped answering (NVML_ERROR_GPU_IS_LOST and friends): drop it, keep the others."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"GPU lost: {detail}")
        self.detail = detail


def is_na(value: object) -> bool:
    return isinstance(value, float) and math.isnan(value)


class _Never(Exception):
    """Matches nothing: stands in for an exception class a module does not have."""


def _import_pynvml() -> Any:
    return importlib.import_module("pynvml")


class Nvml:
    """Thread-safe lazy handle on an NVML module.

    ``module`` is anything shaped like ``pynvml`` (functions, ``NVMLError`` with ``.value``).
    ``init()`` runs ``nvmlInit`` once under a lock; ``shutdown()`` undoes it and is also registered
    with ``atexit``. Every call goes through :meth:`call` / :meth:`query`, which translate errors.
    """

    def __init__(self, module: Any = None) -> None:
        self._module = module
        self._lock = threading.Lock()
        self._initialized = False
        self._atexit_registered = False
        self._na_logged: set[str] = set()

    # -- life cycle -------------------------------------------------------------------------
    @property
    def module(self) -> Any:
        if self._module is None:
            try:
                self._module = _import_pynvml()
            except ImportError as exc:
                raise NvmlUnavailable(
                    f"python package nvidia-ml-py is not installed ({exc})", "pip install nvidia-ml-py"
                ) from None
        return self._module

    @property
    def initialized(self) -> bool:
        return self._initialized

    def init(self) -> None:
        """Initialise NVML once; raises NvmlUnavailable with a one-line reason."""
        if self._initialized:
            return
        with self._lock:
            if self._initialized:
                return
            mod = self.module
            try:
                mod.nvmlInit()
            except mod.NVMLError as exc:
                code = getattr(exc, "value", None)
                hint = _HINTS.get(code) if isinstance(code, int) else None
                raise NvmlUnavailable(f"{exc} (NVML error {code})", hint or _default_hint()) from None
            except OSError as exc:  # a broken libnvidia-ml.so can fail in the dynamic loader itself
                raise NvmlUnavailable(
                    f"cannot load NVML: {exc}", _HINTS[NVML_ERROR_LIBRARY_NOT_FOUND]
                ) from None
            self._initialized = True
            if not self._atexit_registered:
                atexit.register(self.shutdown)
                self._atexit_registered = True

    def shutdown(self) -> None:
        """Undo ``init``; safe to call twice and at interpreter exit."""
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            try:
                self.module.nvmlShutdown()
            except Exception as exc:  # at exit nothing useful can be done with it
                log.debug("nvmlShutdown failed: %s", exc)

    # -- calls ------------------------------------------------------------------------------
    def _resolve(self, fn: str | Callable[..., Any]) -> tuple[str, Callable[..., Any] | None]:
        if callable(fn):
            return getattr(fn, "__name__", repr(fn)), fn
        return fn, getattr(self.module, fn, None)

    def call(self, fn: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call an NVML function; NVML errors come back as ``module.NVMLError`` except lost GPUs
        (:class:`GpuLost`). Initialises NVML first if needed."""
        self.init()
        name, func = self._resolve(fn)
        if func is None:
            raise NvmlUnavailable(f"this nvidia-ml-py has no {name}", "upgrade nvidia-ml-py")
        mod = self.module
        try:
            return func(*args, **kwargs)
        except mod.NVMLError as exc:
            if getattr(exc, "value", None) in _LOST_ERRORS:
                raise GpuLost(f"{name}: {exc}") from None
            raise

    def query(self, fn: str | Callable[..., Any], *args: Any, default: Any = NA, **kwargs: Any) -> Any:
        """Like :meth:`call`, but a value the GPU/driver cannot give becomes ``default`` (N/A).

        Only a lost GPU raises (:class:`GpuLost`); so does a library that went away.
        """
        name, func = self._resolve(fn)
        if func is None:  # older nvidia-ml-py without this binding: N/A, not a crash
            self._note_na(name, "no such binding")
            return default
        mod = self.module
        # pynvml raises this plain Exception when an unversioned binding meets an older driver
        mismatch = getattr(mod, "NVMLLibraryMismatchError", None) or _Never
        try:
            return self.call(func, *args, **kwargs)
        except mismatch as exc:
            self._note_na(name, str(exc))
            return default
        except mod.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in _NA_ERRORS:
                self._note_na(name, str(exc))
                return default
            if code == NVML_ERROR_UNINITIALIZED:
                raise NvmlUnavailable(f"{name}: NVML not initialised") from None
            self._note_na(name, f"{exc} (NVML error {code})")
            return default

    def error_code(self, exc: BaseException) -> int | None:
        """The NVML error code of ``exc`` if it is the module's NVMLError, else None."""
        if isinstance(exc, self.module.NVMLError):
            value = getattr(exc, "value", None)
            return value if isinstance(value, int) else None
        return None

    def _note_na(self, name: str, why: str) -> None:
        # once per function: an unsupported field is a property of the GPU, not news every second
        if name not in self._na_logged:
            self._na_logged.add(name)
            log.info("NVML %s not available here: %s (reported as N/A)", name, why)

    # -- convenience ------------------------------------------------------------------------
    def device_count(self) -> int:
        return int(self.call("nvmlDeviceGetCount"))

    def handle(self, index: int) -> Any:
        return self.call("nvmlDeviceGetHandleByIndex", index)

    def driver_version(self) -> str:
        return as_str(self.query("nvmlSystemGetDriverVersion", default="N/A"))


def _default_hint() -> str:
    return "check the NVIDIA driver with `nvidia-smi`; the GPU collector stays off, the agent runs on"


def as_str(value: Any) -> str:
    """NVML strings are ``bytes`` in old bindings and ``str`` in new ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
