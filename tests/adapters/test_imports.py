"""The adapters load their SDK when constructed, never on import, and export what they say."""

from __future__ import annotations

import subprocess
import sys

import runtime.adapters

SDKS = ("openai", "anthropic", "httpx2", "httpx")


def loaded_after(code: str) -> list[str]:
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {SDKS!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    return done.stdout.split()


def test_importing_runtime_and_the_adapters_imports_no_sdk():
    code = (
        "import runtime, runtime.adapters, runtime.adapters.errors, runtime.adapters.usage\n"
        "import runtime.adapters.openai_compat, runtime.adapters.anthropic"
    )
    assert loaded_after(code) == []


def test_constructing_an_adapter_imports_its_sdk_only():
    code = (
        "from runtime.adapters import OpenAICompatible\n"
        "OpenAICompatible('m', base_url='http://127.0.0.1:9/v1')"
    )
    loaded = loaded_after(code)
    assert "openai" in loaded and "anthropic" not in loaded


def test_exports_match_all():
    public = {n for n in dir(runtime.adapters) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(runtime.adapters, n)).__name__ == "module"}
    assert set(runtime.adapters.__all__) == public - modules
