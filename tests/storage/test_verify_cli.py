"""``ratchet verify``: the store audit from the command line, on SQLite, PostgreSQL, Redis.

The threads are real Runs (``test_integrity.make_victim``); each tampering case of
test_integrity.py is run through the CLI here: exit 1, every bad thread named with its
seq, the good threads not named. The CLI runs in a worker thread (it owns its event
loop, ``asyncio.run``), against the same store URL the test's store has open.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from sqlalchemy import update
from typer.testing import CliRunner

from cluster.cli import app
from runtime.commit import ThreadCommit
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import frontier_checksum
from storage.schema import commits, threads
from tests.storage.test_integrity import (
    CASE_IDS,
    CASES,
    Case,
    T,
    Victim,
    applies,
    make_victim,
    sha,
    tamper_for,
)

REDIS_DB = 15
"""This file's own Redis database (the shared fixture's db 9 is flushed by other suites)."""
OTHER = ThreadId("bystander")


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    """The backends a URL names (the memory store lives in one process only)."""
    return str(request.param)


@pytest.fixture
def redis_test_url(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"


async def ratchet(*args: str) -> Result:
    """``ratchet ARGS`` in-process (its own loop, in a worker thread)."""
    return await asyncio.to_thread(CliRunner().invoke, app, list(args))


def problem_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("corrupt:")]


# ---- clean stores -------------------------------------------------------------------------


async def test_an_empty_store_verifies(store: Any, backend_url: str) -> None:
    result = await ratchet("verify", "--all", "--store", backend_url)
    assert result.exit_code == 0, result.output
    assert "0 threads audited, 0 with problems" in result.stdout


async def test_a_clean_store_verifies_every_thread(store: Any, backend_url: str) -> None:
    victim = await make_victim(store)
    await make_victim(store, OTHER)
    await victim.runner(store).resume(victim.approval())  # one Run ended, one awaiting
    done = await ratchet("verify", "--all", "--store", backend_url)
    assert done.exit_code == 0, done.output
    assert "2 threads audited, 0 with problems" in done.stdout
    assert problem_lines(done) == []
    one = await ratchet("verify", T, "--store", backend_url)
    assert one.exit_code == 0, one.output
    assert "1 threads audited, 0 with problems" in one.stdout


# ---- tampered stores ----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
async def test_a_tampered_thread_is_named_with_its_seq(
    store: Any, backend: str, backend_url: str, case: Case, request: pytest.FixtureRequest
) -> None:
    applies(case, backend)
    victim = await make_victim(store)
    await make_victim(store, OTHER)
    await case.edit(tamper_for(store, backend), victim)
    every = await ratchet("verify", "--all", "--store", backend_url)
    assert every.exit_code == 1, every.output
    lines = problem_lines(every)
    if case.name == "record-moved-to-another-thread":  # a log no thread row vouches for
        stray = lines.pop()
        assert "thread 'x' seq 3:" in stray and "no frontier vouches for" in stray
        assert "3 threads audited, 2 with problems" in every.stdout
    else:
        assert "2 threads audited, 1 with problems" in every.stdout
    [line] = lines
    assert any(f"thread '{T}' seq {seq}:" in line for seq in case.seqs), line
    assert OTHER not in every.stderr
    alone = await ratchet("verify", T, "--store", backend_url)
    assert alone.exit_code == 1 and problem_lines(alone) == [line]
    other = await ratchet("verify", OTHER, "--store", backend_url)
    assert other.exit_code == 0, other.output


async def test_every_bad_thread_is_listed(store: Any, backend: str, backend_url: str) -> None:
    names = [ThreadId(f"t-{i}") for i in range(4)]
    victims = {name: await make_victim(store, name) for name in names}
    t0, t1, t2 = (tamper_for(store, backend, name) for name in names[:3])
    await t0.set_record(2, victims[names[0]].bodies[1].replace("looking", "LOOKING"))
    await t1.set_record(4, hash_=sha("not the hash"))
    await t2.set_meta(checksum=sha("not the checksum"))
    result = await ratchet("verify", "--all", "--store", backend_url)
    assert result.exit_code == 1, result.output
    lines = problem_lines(result)
    assert len(lines) == 3
    for name, seq, line in zip(names[:3], (2, 4, 5), lines, strict=True):
        assert line.startswith(f"corrupt: thread '{name}' seq {seq}:"), line
    assert "'t-3'" not in result.stderr
    assert "4 threads audited, 3 with problems" in result.stdout


async def _rewrite_frontier(tamper: Any, change: Any) -> None:
    """A frontier edited *with* its checksum recomputed: only the replay can tell."""
    data = json.loads(await tamper.frontier())
    change(data)
    text = json.dumps(data)
    await tamper.set_meta(frontier=text, checksum=frontier_checksum(text))


async def test_a_frontier_that_is_not_the_fold_of_its_log(
    store: Any, backend: str, backend_url: str
) -> None:
    victim = await make_victim(store)
    tamper = tamper_for(store, backend)

    def promote(data: dict[str, Any]) -> None:
        data["batch"]["calls"][0]["arguments"] = '{"path": "EVIL"}'

    await _rewrite_frontier(tamper, promote)
    assert (await store.load(T)).batch.calls[0].arguments == '{"path": "EVIL"}'
    assert len(await store.read(T)) == 5  # the log and the checksum both hold
    result = await ratchet("verify", T, "--store", backend_url)
    assert result.exit_code == 1, result.output
    [line] = problem_lines(result)
    assert line.startswith(f"corrupt: thread '{T}' seq 5: the frontier is not the fold")
    assert victim.ran == []


@pytest.mark.parametrize("edit", ["running", "ordinal", "epoch"])
async def test_a_frontier_that_is_not_its_last_records_fold_is_not_served(
    store: Any, backend: str, edit: str
) -> None:
    """A Run awaiting in the log made running in the frontier (its checksum made again):
    a recovery drove it on, and the commits it appended hid the edit from ``verify``. An
    epoch past a BIGINT read fine, then failed every claim as the database's overflow (a
    store error, retried at every sweep), not as a corrupt thread."""
    victim = await make_victim(store)
    tamper = tamper_for(store, backend)

    def forge(data: dict[str, Any]) -> None:
        if edit == "running":
            data["run_state"] = {"kind": "running", "run_id": data["run_id"]}
        elif edit == "ordinal":
            data["next_ordinal"] += 7
        else:
            data["epoch"] = 10**30

    await _rewrite_frontier(tamper, forge)
    wrong = "less than 9223372036854775808" if edit == "epoch" else "does not match its last"
    with pytest.raises(CorruptRecord, match=wrong):
        await store.load(T)
    assert victim.ran == []


async def test_a_log_that_does_not_replay_names_the_record_the_fold_refuses(
    store: Any, backend: str, backend_url: str
) -> None:
    """The last record forged with an ordinal out of turn, its hash, the head and the
    frontier's checksum all recomputed: every hash holds, the fold does not."""
    victim = await make_victim(store)
    tamper = tamper_for(store, backend)
    data = json.loads(victim.bodies[4])
    data["ordinal"] = 9
    forged = ThreadCommit.model_validate(data)
    await tamper.set_record(5, forged.encoded, forged.payload_hash)
    if backend in ("sqlite", "postgres"):  # the column beside the body is checked too
        async with store.engine.begin() as conn:
            row = (commits.c.thread_id == T) & (commits.c.seq == 5)
            await conn.execute(update(commits).where(row).values(operation_id=forged.operation_id))
    await tamper.set_meta(head=forged.payload_hash)

    def new_head(frontier: dict[str, Any]) -> None:  # as folding the forged record makes it
        frontier["head"], frontier["next_ordinal"] = forged.payload_hash, 10

    await _rewrite_frontier(tamper, new_head)
    assert len(await store.read(T)) == 5
    result = await ratchet("verify", "--all", "--store", backend_url)
    assert result.exit_code == 1, result.output
    [line] = problem_lines(result)
    assert line.startswith(f"corrupt: thread '{T}' seq 5: the log does not replay"), line


async def test_an_operation_id_column_that_is_not_the_bodys(
    store: Any, backend: str, backend_url: str
) -> None:
    if backend != "sqlite":
        pytest.skip("one SQL backend shows it")
    await make_victim(store)
    async with store.engine.begin() as conn:
        row = (commits.c.thread_id == T) & (commits.c.seq == 4)
        await conn.execute(update(commits).where(row).values(operation_id="someone-else:0"))
    result = await ratchet("verify", T, "--store", backend_url)
    assert result.exit_code == 1, result.output
    assert f"thread '{T}' seq 4:" in result.stderr


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_a_listing_that_cannot_go_on_still_says_what_was_found(
    store: Any, backend_url: str
) -> None:
    """A thread row whose id SQLite holds as a BLOB ends the listing of threads (its id
    cannot be the next page's cursor): ``verify --all`` ended in that error and printed
    none of the problems it had found."""
    await make_victim(store)
    other = ThreadId("other")
    await make_victim(store, other)
    async with store.engine.begin() as conn:
        row = (commits.c.thread_id == T) & (commits.c.seq == 4)
        await conn.execute(update(commits).where(row).values(operation_id="someone-else:0"))
        await conn.execute(
            update(threads).where(threads.c.thread_id == other).values(thread_id=b"\xff\x00")
        )
    result = await ratchet("verify", "--all", "--store", backend_url)
    assert result.exit_code == 1, result.output
    found = problem_lines(result)
    assert any(line.startswith(f"corrupt: thread '{T}' seq 4:") for line in found), found
    assert len(found) == 3  # 'other' lost its row; the BLOB row has no records
    assert "verify stopped after 3 threads" in result.stderr
    assert "verify stopped after" in result.stderr


# ---- arguments and stores -----------------------------------------------------------------


@pytest.mark.parametrize("args", [[], ["some-thread", "--all"]], ids=["neither", "both"])
async def test_a_thread_or_all_but_not_both(args: list[str], tmp_path: Path) -> None:
    result = await ratchet("verify", *args, "--store", f"sqlite:///{tmp_path}/r.db")
    assert result.exit_code == 1
    assert "give a THREAD or --all" in result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "r.db").exists()  # refused before the store was opened


async def test_an_unreachable_store_is_one_line_and_exit_1() -> None:
    result = await ratchet("verify", "--all", "--store", "postgresql://postgres@127.0.0.1:1/x")
    assert result.exit_code == 1
    assert result.stderr.startswith("error:") and len(result.stderr.splitlines()) == 1
    assert "Traceback" not in result.output


def test_the_installed_command_exits_1_naming_the_bad_thread(tmp_path: Path) -> None:
    """The real entry point, in its own process, on a SQLite file."""
    url = f"sqlite:///{tmp_path}/store/ratchet.db"
    ratchet_bin = Path(sys.executable).with_name("ratchet")

    async def build() -> Victim:
        from storage.sql import SqlCommitStore

        store = await SqlCommitStore.connect(url)
        try:
            victim = await make_victim(store)
            await tamper_for(store, "sqlite").set_record(3, hash_=sha("x"))
            return victim
        finally:
            await store.close()

    asyncio.run(build())
    env = {**os.environ, "RATCHET_STORE_URL": url}
    run = subprocess.run(
        [str(ratchet_bin), "verify", "--all"], capture_output=True, text=True, env=env, timeout=60
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"thread '{T}' seq 3:" in run.stderr
    assert "1 threads audited, 1 with problems" in run.stdout
