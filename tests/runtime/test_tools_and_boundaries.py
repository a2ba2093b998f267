"""@tool, the import boundary of runtime/, and the curated public surface."""

from __future__ import annotations

import subprocess
import sys

import pytest

import runtime
from runtime import ToolContext, ToolDefinitionError, tool


def test_tool_builds_an_argument_model_from_the_signature():
    @tool(recovery=("replay_safe", "idempotent"), concurrency="serial")
    def search(query: str, limit: int = 5, ctx: ToolContext | None = None) -> str:
        """Search the index."""
        return query

    assert search.id == "search" and search.concurrency == "serial"
    assert search.default_policy.mode == "replay_safe"
    assert search.supports("never_replay") and search.supports("idempotent")
    assert not search.supports("durable_request")
    assert search.parse('{"query": "x"}') == {"query": "x", "limit": 5}
    schema = search.schema()
    assert schema["description"] == "Search the index."
    assert set(schema["parameters"]["properties"]) == {"query", "limit"}


def test_context_parameter_is_found_by_annotation():
    @tool
    def f(x: int, context: ToolContext) -> int:
        return x

    assert f.context_param == "context"
    assert "context" not in f.schema()["parameters"]["properties"]


@pytest.mark.parametrize(
    "kwargs", [{"recovery": ("sometimes",)}, {"recovery": ()}, {"concurrency": "wild"}]
)
def test_bad_declarations_raise(kwargs):
    with pytest.raises(ToolDefinitionError):

        @tool(**kwargs)
        def f() -> None: ...


def test_var_args_are_refused():
    with pytest.raises(ToolDefinitionError, match=r"\*args"):

        @tool
        def f(*items: int) -> None: ...


def test_importing_runtime_imports_no_ray_redis_or_sqlalchemy():
    code = (
        "import sys, runtime, runtime.engine, runtime.runner, runtime.stream, runtime.delegation\n"
        "bad = [m for m in ('ray', 'redis', 'sqlalchemy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_exports_match_all():
    exported = set(runtime.__all__)
    public = {name for name in dir(runtime) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(runtime, name)).__name__ == "module"}
    assert exported == public - modules
    assert len(runtime.__all__) == len(exported)
