"""One of two racing clients, run by test_races as a separate OS process.

    python -m tests.ray.race_client CONFIG.json

It joins the test session's Ray cluster and system (``Ratchet.connect`` with the same
store URL and system name), then plays the config's rounds. For each round it first
prepares everything it can (a resume's command is built from the committed ticket),
writes ``<barrier>/ready-<round>-<role>`` and waits — with a deadline — for
``<barrier>/go-<round>``, which the test writes once both clients are ready, so the
two processes' calls overlap. Then it makes every call of the round at once.

Config: ``{"address", "store_url", "name", "hosts", "role", "barrier", "deadline_s",
"rounds": [{"action": "start"|"resume"|"cancel"|"fork", "agent", "calls": [{"thread",
"run_id", "host", "new_thread" (a start's, optional), "input" (a start's, optional),
"approve" (a resume's, optional), "source" (a fork's: it forks ``source`` at its head
into ``thread``)}]}]}``; a cancel's answer (``cancelled``, ``signalled``, ...) is its
``detail``. ``"connect_race": true``: the client connects (starting the system, if
nobody did) only at the go of round ``connect``, with the ``hosts`` of its config. Prints one line
``RESULT <json>``: per round, per thread, ``{"outcome": "ok" | <error type name>,
"detail": <its message>, "rest": <how the Run rests> | <error type>}`` where
``rest`` is ``awaiting`` or ``ended:<cause>``, learnt through ``result()`` within the
deadline (``TimeoutError`` if it hung).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import ray

from cluster.client import Ratchet, RunHandle, command_for
from runtime.commit import Frontier
from runtime.ids import ThreadId
from runtime.lifecycle import AwaitingState, EndedState, PermissionDecision, ResumeCommand
from tests.support.waiting import until


def _rest(frontier: Frontier) -> str:
    state = frontier.run_state
    if isinstance(state, EndedState):
        return f"ended:{state.cause.kind}"
    if isinstance(state, AwaitingState):
        return "awaiting"
    return f"not at rest: {state!r}"


async def _barrier(barrier: Path, round_no: int | str, role: str, deadline_s: float) -> None:
    (barrier / f"ready-{round_no}-{role}").write_text("ready")
    go = barrier / f"go-{round_no}"
    await until(go.exists, deadline_s, what=f"the go for round {round_no}")


async def _outcome(call: Any, deadline_s: float) -> tuple[str, str, Any]:
    try:
        value = await asyncio.wait_for(call, deadline_s)
    except Exception as exc:  # the race's loser: its error's type is the finding
        return type(exc).__name__, str(exc)[:300], None
    return "ok", "", value


async def _rests(handle: RunHandle, deadline_s: float) -> str:
    try:
        return _rest(await handle.result(timeout_s=deadline_s))
    except Exception as exc:
        return type(exc).__name__


async def _start_round(client: Ratchet, spec: dict[str, Any], deadline_s: float, go: Any) -> Any:
    await go()

    async def one(call: dict[str, Any]) -> tuple[str, str, Any]:
        start = client.start(
            spec["agent"],
            call.get("input", "race"),
            thread_id=call["thread"],
            run_id=call["run_id"],
            host=call["host"],
            new_thread=call.get("new_thread", False),
        )
        return await _outcome(start, deadline_s)

    outcomes = await asyncio.gather(*(one(c) for c in spec["calls"]))
    report: dict[str, Any] = {}
    for call, (outcome, detail, handle) in zip(spec["calls"], outcomes, strict=True):
        # the winner's own handle; for a loser, the thread's latest Run (the winner's)
        follow = handle if handle is not None else client.handle(call["thread"])
        rest = await _rests(follow, deadline_s)
        report[call["thread"]] = {"outcome": outcome, "detail": detail, "rest": rest}
    return report


async def _awaiting_round(client: Ratchet, spec: dict[str, Any], deadline_s: float, go: Any) -> Any:
    """Resume (approve) or cancel Runs that await a permission."""
    commands: dict[str, ResumeCommand] = {}
    for call in spec["calls"]:
        ticket = await client.handle(call["thread"]).ticket()
        assert ticket is not None, f"{call['thread']} is not awaiting"
        decision = PermissionDecision(approve=call.get("approve", True), note=config_role())
        commands[call["thread"]] = command_for(ticket, decision)
    await go()

    async def one(call: dict[str, Any]) -> tuple[str, str, Any]:
        handle = client.handle(call["thread"])
        if spec["action"] == "cancel":
            return await _outcome(handle.cancel(), deadline_s)
        return await _outcome(
            handle.resume(commands[call["thread"]], host=call["host"]), deadline_s
        )

    outcomes = await asyncio.gather(*(one(c) for c in spec["calls"]))
    report: dict[str, Any] = {}
    for call, (outcome, detail, value) in zip(spec["calls"], outcomes, strict=True):
        run = commands[call["thread"]].run_id
        handle = RunHandle(client, ThreadId(call["thread"]), run, "hosted")
        rest = await _rests(handle, deadline_s)
        detail = value if isinstance(value, str) else detail  # cancel's answer
        report[call["thread"]] = {"outcome": outcome, "detail": detail, "rest": rest}
    return report


async def _fork_round(client: Ratchet, spec: dict[str, Any], deadline_s: float, go: Any) -> Any:
    """Fork each call's ``source`` at its head into ``thread`` (its Run has ended)."""
    heads = {}
    for call in spec["calls"]:
        heads[call["source"]] = (await client.store.load(ThreadId(call["source"]))).version
    await go()

    async def one(call: dict[str, Any]) -> tuple[str, str, Any]:
        fork = client.fork(call["source"], heads[call["source"]], call["thread"])
        return await _outcome(fork, deadline_s)

    outcomes = await asyncio.gather(*(one(c) for c in spec["calls"]))
    report: dict[str, Any] = {}
    for call, (outcome, detail, _) in zip(spec["calls"], outcomes, strict=True):
        rest = await _rests(client.handle(call["thread"]), deadline_s)
        report[call["thread"]] = {"outcome": outcome, "detail": detail, "rest": rest}
    return report


async def _end_round(client: Ratchet, spec: dict[str, Any], deadline_s: float, go: Any) -> Any:
    """Cancel (or stop, ``"reason"``) each call's thread's Run, running or not, through
    the host its thread hashes to."""
    runs = {
        c["thread"]: (await client.store.load(ThreadId(c["thread"]))).run_id for c in spec["calls"]
    }
    await go()

    async def one(call: dict[str, Any]) -> tuple[str, str, Any]:
        handle = client.handle(call["thread"], runs[call["thread"]])
        reason = spec.get("reason")
        return await _outcome(
            handle.cancel() if reason is None else handle.stop(reason), deadline_s
        )

    outcomes = await asyncio.gather(*(one(c) for c in spec["calls"]))
    report: dict[str, Any] = {}
    for call, (outcome, detail, value) in zip(spec["calls"], outcomes, strict=True):
        rest = await _rests(client.handle(call["thread"], runs[call["thread"]]), deadline_s)
        detail = value if isinstance(value, str) else detail
        report[call["thread"]] = {"outcome": outcome, "detail": detail, "rest": rest}
    return report


_ROLE: list[str] = []


def config_role() -> str:
    """This client's role: the note of its permission decisions (whose landed)."""
    return _ROLE[0] if _ROLE else ""


PLAYS = {"start": _start_round, "fork": _fork_round, "end": _end_round}


async def main(config: dict[str, Any]) -> dict[str, Any]:
    address = config["address"]
    _ROLE.append(config["role"])
    ray.init(address=address, namespace="ratchet", log_to_driver=False)
    if config.get("connect_race"):
        barrier = Path(config["barrier"])
        await _barrier(barrier, "connect", config["role"], config["deadline_s"])
        try:
            client = await _connected(config)
        except Exception as exc:  # the race's loser: its error's type is the finding
            return {"connect": {"outcome": type(exc).__name__, "detail": str(exc)[:300]}}
        try:
            running = ray.get_actor(client.spec.supervisor_name, namespace="ratchet")
            spec = await running.system_spec.remote()
            return {
                "connect": {
                    "outcome": "ok",
                    "hosts": client.spec.hosts,
                    "system_hosts": spec.hosts,
                }
            }
        finally:
            await client.close()
    client = await _connected(config)
    barrier, role, deadline_s = Path(config["barrier"]), config["role"], config["deadline_s"]
    results: dict[str, Any] = {}
    try:
        for round_no, spec in enumerate(config["rounds"]):

            async def go(n: int = round_no) -> None:
                await _barrier(barrier, n, role, deadline_s)

            play = PLAYS.get(spec["action"], _awaiting_round)
            results[str(round_no)] = await play(client, spec, deadline_s, go)
    finally:
        await client.close()
    return results


async def _connected(config: dict[str, Any]) -> Ratchet:
    return await Ratchet.connect(
        address=config["address"],
        store_url=config["store_url"],
        name=config["name"],
        hosts=config["hosts"],
        quiet=True,
    )


if __name__ == "__main__":
    found = asyncio.run(main(json.loads(Path(sys.argv[1]).read_text())))
    print("RESULT " + json.dumps(found), flush=True)
    ray.shutdown()
