"""NVML and amdsmi, imported lazily and initialised once per process.

Both libraries are optional (the operator image and CI have neither) and both
keep global state in the driver, so the first caller initialises under a lock,
shutdown is registered with atexit, and a failure is remembered rather than
retried on every report. Neither touches CUDA/HIP contexts.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import threading
from collections.abc import Callable
from types import ModuleType

log = logging.getLogger(__name__)


class ManagedLibrary:
    """A vendor management library that is initialised at most once and shut down at exit."""

    def __init__(
        self,
        import_name: str,
        init: Callable[[ModuleType], object],
        shutdown: Callable[[ModuleType], object],
    ) -> None:
        self.import_name = import_name
        self._init = init
        self._shutdown = shutdown
        self._lock = threading.Lock()
        self._tried = False
        self._module: ModuleType | None = None
        self.error: str | None = None  # why get() returned None

    def get(self) -> ModuleType | None:
        """The initialised module, or None when it is missing or its driver is not there."""
        with self._lock:
            if not self._tried:
                self._tried = True
                self._module = self._load()
            return self._module

    def _load(self) -> ModuleType | None:
        try:
            module = importlib.import_module(self.import_name)
        except ImportError:
            self.error = f"{self.import_name} is not installed"
            return None
        try:
            self._init(module)
        except Exception as exc:  # each library raises its own error type
            self.error = f"{self.import_name} failed to initialise: {exc}"
            log.info("topology: %s", self.error)
            return None
        atexit.register(self._close, module)
        return module

    def _close(self, module: ModuleType) -> None:
        try:
            self._shutdown(module)
        except Exception as exc:
            log.debug("topology: %s shutdown failed: %s", self.import_name, exc)


def _amdsmi_init(module: ModuleType) -> None:
    flags = getattr(module, "AmdSmiInitFlags", None)
    if flags is not None:
        module.amdsmi_init(flags.INIT_AMD_GPUS)
    else:
        module.amdsmi_init()


NVML = ManagedLibrary("pynvml", lambda m: m.nvmlInit(), lambda m: m.nvmlShutdown())
AMDSMI = ManagedLibrary("amdsmi", _amdsmi_init, lambda m: m.amdsmi_shut_down())
