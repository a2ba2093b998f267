"""Delegation scenario: P parents each fanning out to 4 concurrent children (issue 6).

    python -m benchmarks.delegation --parents 100 --json

Every parent and child must end naturally with the expected answers, each child
exactly once; the JSON line reports wall time and Runs per second.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time

import typer

from cluster.client import Ratchet
from runtime import Agent, ModelResponse, ScriptedModel, call
from runtime.delegation import delegate_tool
from runtime.messages import UserMessage

HERE = "benchmarks.delegation"


def _input(request) -> str:  # type: ignore[no-untyped-def]
    return next(m.text for m in request.messages if isinstance(m, UserMessage))


worker = Agent(
    name="worker",
    model=ScriptedModel([lambda r: ModelResponse(text=f"done: {_input(r)}")]),
)


def fanout(children: int) -> Agent:
    calls = tuple(
        call("delegate", f"d{i}", agent=f"{HERE}:worker", input=f"task {i}")
        for i in range(children)
    )
    return Agent(
        name=f"fanout{children}",
        model=ScriptedModel(
            [
                ModelResponse(tool_calls=calls),
                lambda r: ModelResponse(
                    text=json.dumps([m.content for m in r.messages if m.kind == "tool_result"])
                ),
            ]
        ),
        tools=[delegate_tool()],
    )


def fanout4() -> Agent:
    return fanout(4)


async def scenario(parents: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="ratchet-delegation-") as tmp:
        client = await Ratchet.connect(store_url=f"sqlite:///{tmp}/store.db")
        try:
            began = time.perf_counter()
            handles = [await client.start(f"{HERE}:fanout4", f"p{i}") for i in range(parents)]
            rows = await client.wait_all(handles, timeout_s=600)
            wall = time.perf_counter() - began
            finals = [await h.frontier() for h in handles]
            ended = await client.store.list_runs("ended")
        finally:
            await client.shutdown()
    expected = json.dumps([f"done: task {i}" for i in range(4)])
    ok = (
        all(r.cause == "natural" for r in rows)
        and all(f.messages[-1].text == expected for f in finals)
        and len(ended) == parents * 5
    )
    return {
        "parents": parents,
        "children": parents * 4,
        "runs": len(ended),
        "ok": ok,
        "wall_s": round(wall, 2),
        "runs_per_s": round(len(ended) / wall, 1),
    }


def main(
    parents: int = typer.Option(100, help="Parent Runs, each delegating to 4 children"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON line"),
) -> None:
    result = asyncio.run(scenario(parents))
    print(json.dumps(result) if as_json else result)
    raise typer.Exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    typer.run(main)
