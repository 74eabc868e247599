"""gonixl: a vLLM KV connector whose engine is a Go library (libgonixl.so).

Importing this package loads nothing; the library is loaded on first use.
vLLM loads the connector with
``kv_connector_module_path="gonixl.vllm"`` and ``kv_connector="GoNixlConnector"``.
"""

from __future__ import annotations

from . import errors
from .errors import GoNixlError, LibraryLoadError

__all__ = ["GoNixlError", "LibraryLoadError", "errors", "library_version", "probe", "abi_version"]


def abi_version() -> int:
    """The ABI version of the loaded library."""
    from . import _lib

    return int(_lib.lib().gonixl_abi_version())


def library_version() -> str:
    """The library's version string."""
    from . import engine

    return engine.library_version()


def live_objects() -> dict:
    """The library's open scheduler and worker handles and parked results
    (test suites end by asserting all are 0). Loads the library."""
    from . import engine

    return engine.live_objects()


def probe() -> dict:
    """What the library finds on this host: version and transfer engines."""
    from . import engine

    return engine.probe()
