"""The old module path of the SGLang storage backend, which now lives in
:mod:`gdskv.connectors.sglang`.

Engine configs that name ``"module_path": "gdskv.engine.sglang"`` keep working: this module
re-exports the backend's public names (the same objects). New configs should name
``gdskv.connectors.sglang``.
"""

from gdskv.connectors.sglang import SGLANG_KEYS, GdskvHiCacheStorage

__all__ = ["GdskvHiCacheStorage", "SGLANG_KEYS"]
