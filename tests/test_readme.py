"""The README's library example runs as written (docs that match the code)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_library_example_runs():
    (example,) = python_blocks()
    out = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.splitlines()[0] == "natural - Done: Ada was charged 42."
    assert "1 activation ['run_started', 'status']" in out
