"""The auth rule of ``ratchet serve`` and its command line, without Ray or a server."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import edge
from cluster.cli import app
from edge.options import ServeOptions, ServeRefused, is_loopback, tokens_from


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        (ServeOptions(host="0.0.0.0", no_auth=True), "only allowed on a loopback address"),
        (ServeOptions(host="10.1.2.3", no_auth=True), "only allowed on a loopback address"),
        (ServeOptions(host="myhost", no_auth=True), "only allowed on a loopback address"),
        (ServeOptions(no_auth=True, tokens=("t",)), "goes with no token"),
        (ServeOptions(host="0.0.0.0"), "no token: give --token"),
        (ServeOptions(tokens=(" t",)), "may not be empty"),
    ],
)
def test_the_auth_rule_refuses(options, refusal):
    with pytest.raises(ServeRefused, match=refusal):
        options.checked()


def test_the_auth_rule_allows():
    for host in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        ServeOptions(host=host, no_auth=True).checked()
    ServeOptions(host="0.0.0.0", tokens=("secret",)).checked()
    assert tokens_from(["a", " b "], {"RATCHET_TOKENS": "b,c,,"}) == ("a", "b", "c")
    assert "secret" not in repr(ServeOptions(tokens=("secret",)))


def test_serve_refuses_no_auth_off_loopback_before_starting_anything():
    result = CliRunner().invoke(app, ["serve", "--no-auth", "--host", "0.0.0.0"])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (
        "error: --no-auth is only allowed on a loopback address, not '0.0.0.0'"
    )
    result = CliRunner().invoke(app, ["serve"], env={"RATCHET_TOKENS": ""})
    assert result.exit_code == 1 and "error: no token" in result.output
    result = CliRunner().invoke(app, ["serve", "--token", "t"])  # which agents, then?
    assert result.exit_code == 1 and "--any-agent" in result.output


def test_serve_help_is_complete_and_the_cli_loads_no_web_framework():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    options = "--host --port --store --redis --address --token --no-auth --cors-origin"
    for option in (*options.split(), "--agent", "--any-agent", "--hosts", "--executors"):
        assert option in result.output
    code = (
        "import sys, cluster.cli; "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'sse_starlette', 'ag_ui') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_exports_are_exactly_the_public_names():
    public = {
        name
        for name, value in vars(edge).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert set(edge.__all__) == public
