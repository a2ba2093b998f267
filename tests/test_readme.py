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
    example = python_blocks()[0]  # the first: the library example, complete
    out = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.splitlines()[0] == "natural - Done: Ada was charged 42."
    assert "1 activation ['run_started', 'status']" in out


def test_every_python_block_of_the_readme_is_python():
    """The other blocks are fragments (they name things the text introduces): each must
    at least parse."""
    for block in python_blocks():
        compile(block, "README.md", "exec")


def test_readme_limits_table_is_the_code_s():
    """Every limit, its default and what it bounds, as ``runtime.limits`` defines them."""
    from runtime.limits import limits_table

    text = README.read_text()
    rows = re.findall(r"^\| `(\w+)` \| ([\d,]+) \| (.+) \|$", text, flags=re.M)
    documented = {name: (int(value.replace(",", "")), what) for name, value, what in rows}
    for name, value, what in limits_table():
        assert documented.get(name) == (value, what.replace("``", "`")), name
    failure_kinds = re.findall(r"^\| `(\w+)` \| .+ \| .* \|$", text, flags=re.M)
    from typing import get_args

    from runtime.lifecycle import FailureKind

    assert set(get_args(FailureKind)) <= set(failure_kinds)
