"""Pagoda node daemon: the paged-attention engine, its models, and (later) the server.

`LLM` and `SamplingParams` are imported lazily so that light commands
(`pagoda topology`, `pagoda --help`) never pay for importing torch.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from pagoda_daemon.config import EngineConfig
    from pagoda_daemon.llm import LLM
    from pagoda_daemon.outputs import CompletionOutput, RequestOutput
    from pagoda_daemon.sampling_params import SamplingParams

_LAZY = {
    "LLM": "pagoda_daemon.llm",
    "SamplingParams": "pagoda_daemon.sampling_params",
    "EngineConfig": "pagoda_daemon.config",
    "RequestOutput": "pagoda_daemon.outputs",
    "CompletionOutput": "pagoda_daemon.outputs",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagoda_daemon' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
