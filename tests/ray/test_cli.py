"""The ``ratchet`` CLI: expected failures are one clear line; run, runs and show work."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from actors.wire import RunMeta
from cluster.cli import app
from cluster.cli_json import emit
from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel, call, tool
from runtime.commit import ThreadCommit
from runtime.errors import ModelRefused
from runtime.events import Fact
from runtime.ids import RunId, ThreadId
from runtime.stream import Frame, parse_offset
from storage.url import open_store

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def _ratchet(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, before: str = ""
) -> subprocess.CompletedProcess[str]:
    """``ratchet ARGS`` in a process of its own; ``before``: code run before the CLI."""
    code = f"{before}from cluster.cli import app; app()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("run", "no_such_module:agent", "hi"), "cannot import module 'no_such_module'"),
        (("run", "cluster.demo_agent:nobody", "hi"), "has no attribute 'nobody'"),
        (("run", "not-a-reference", "hi"), "must look like 'package.module:name'"),
        (
            ("run", "cluster.demo_agent:agent", "hi", "--address", "127.0.0.1:1"),
            "cannot reach the Ray cluster at 127.0.0.1:1",
        ),
        (("runs", "--store", "postgresql://u:hunter2@127.0.0.1:1/db"), "u:***@127.0.0.1:1"),
        (("runs", "--store", "ftp://somewhere"), "unsupported store URL"),
    ],
)
def test_expected_failures_are_one_line(args, expected):
    done = _ratchet(*args)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert expected in lines[0]
    assert "hunter2" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "command", [("runs",), ("show", "t"), ("verify", "--all"), ("export", "t")]
)
def test_a_command_on_a_sqlite_store_that_is_not_there_makes_none(tmp_path, command):
    """A mistyped path is said so; it made an empty store there, directories and all."""
    missing = tmp_path / "typo" / "nothing.db"
    done = _ratchet(*command, "--store", f"sqlite:///{missing}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"no store at sqlite:///{missing}: the file does not exist" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("command", [("runs",), ("show", "t"), ("verify", "--all")])
def test_a_command_that_only_reads_writes_no_schema_into_an_empty_store(tmp_path, command):
    """An empty SQLite file (``touch``, or one a failed start left) is no store: a reader
    says so and leaves it empty. It got the six tables."""
    empty = tmp_path / "empty.db"
    empty.touch()
    done = _ratchet(*command, "--store", f"sqlite:///{empty}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"no store at sqlite:///{empty}: the file is empty" in done.stderr
    assert "Traceback" not in done.stderr
    assert empty.stat().st_size == 0


def _one_line(done: subprocess.CompletedProcess[str], expected: str) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], done.stderr


@pytest.mark.parametrize("command", [("runs",), ("show", "t"), ("demo",)])
def test_a_store_path_in_a_symlink_loop_is_one_line(tmp_path, command):
    """``ratchet-data -> ratchet-data``: every command ended in a traceback of pathlib's
    RuntimeError (a loop), 125 lines and more."""
    (tmp_path / "ratchet-data").symlink_to("ratchet-data")
    env = {k: v for k, v in os.environ.items() if k != "RATCHET_STORE_URL"}
    done = _ratchet(*command, cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)})
    _one_line(done, "its path cannot be resolved")


def test_the_demo_with_its_folder_a_file_is_one_line(tmp_path):
    """``./ratchet-data`` a regular file: the other commands said so in one line, the demo
    in a traceback of its ledger's FileExistsError (now its store, there too, says it)."""
    (tmp_path / "ratchet-data").write_text("not a folder")
    env = {k: v for k, v in os.environ.items() if k not in ("RATCHET_STORE_URL", "RATCHET_LEDGER")}
    done = _ratchet("demo", cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)})
    _one_line(done, "cannot open store")
    assert (tmp_path / "ratchet-data").read_text() == "not a folder"


def test_a_demo_refused_its_store_leaves_no_ledger_behind(tmp_path):
    """The demo made ``./ratchet-data/demo-effects.db`` before it asked the store."""
    env = {k: v for k, v in os.environ.items() if k not in ("RATCHET_STORE_URL", "RATCHET_LEDGER")}
    refused = "postgresql://postgres@127.0.0.1:1/none"  # nothing listens on port 1
    done = _ratchet("demo", "--store", refused, cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)})
    _one_line(done, "unavailable")
    assert list(tmp_path.iterdir()) == []


def test_a_terminal_of_width_zero_still_shows_what_went_wrong(tmp_path):
    """``COLUMNS=0``: Rich printed at a width of 0, nothing at all, errors included."""
    store = f"sqlite:///{tmp_path}/none.db"
    done = _ratchet("runs", "--store", store, env={**os.environ, "COLUMNS": "0"})
    _one_line(done, "no store at")


def test_a_command_on_the_default_store_that_is_not_there_makes_no_folder(tmp_path):
    """The default store is a relative path (``ratchet-data/ratchet.db``): making it
    absolute made its folder, so ``ratchet runs`` in an empty directory left one."""
    env_free = {k: v for k, v in os.environ.items() if k != "RATCHET_STORE_URL"}
    done = _ratchet("runs", cwd=tmp_path, env={**env_free, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and "no store at" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_run_then_runs_then_show(tmp_path):
    store = f"sqlite:///{tmp_path}/cli.db"
    runner = CliRunner()
    ran = runner.invoke(
        app, ["run", "tests.ray.agents:quick_agent", "hi", "--thread", "cli-1", "--store", store]
    )
    assert ran.exit_code == 0, ran.output
    assert "said hi" in ran.output and "status: idle reason=natural" in ran.output
    listed = runner.invoke(app, ["runs", "--store", store])
    assert listed.exit_code == 0 and "cli-1" in listed.output and "natural" in listed.output
    shown = runner.invoke(app, ["show", "cli-1", "--store", store])
    assert shown.exit_code == 0
    assert "echo: completed" in shown.output and "running → idle(natural)" in shown.output
    assert re.search(r"history: [\d,]+ of 67,108,864 bytes, \d+ of 50,000 commits", shown.output)
    agent = "tests.ray.agents:quick_agent"
    mine = runner.invoke(app, ["runs", "--json", "--agent", agent, "--store", store])
    row, last = (json.loads(line) for line in mine.stdout.splitlines())
    assert row["thread_id"] == "cli-1" and row["agent"] == agent and row["steps"] == 2
    assert last == {"next": None}


def test_show_prints_usage_per_step_and_in_total(tmp_path):
    from runtime.models import Usage

    store_url = f"sqlite:///{tmp_path}/usage.db"
    used = Usage(input_tokens=120, output_tokens=7, cached_tokens=100, model="gpt-test")

    async def run() -> None:
        store = await open_store(store_url)
        agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="hi", usage=used)]))
        await InProcessRunner(agent, store).start("go", thread_id="u-1")
        await store.close()

    asyncio.run(run())
    shown = CliRunner().invoke(app, ["show", "u-1", "--store", store_url])
    assert shown.exit_code == 0, shown.output
    assert "usage: 120 in (100 cached), 7 out, 1 inference(s) (gpt-test)" in shown.output
    assert "usage (run): 120 in (100 cached), 7 out, 1 inference(s)" in shown.output
    assert "usage (thread): 120 in" in shown.output


def test_show_prints_stored_text_that_looks_like_markup_as_itself(tmp_path):
    """Model, tool and user text (and a model's name) is anyone's: ``[/x]`` once made
    rich raise MarkupError (the command crashed) and ``[bold]`` was swallowed as style."""
    from runtime.models import Usage

    store_url = f"sqlite:///{tmp_path}/markup.db"

    @tool
    def echo(text: str) -> str:
        return f"[red]{text}[/x]"

    async def run() -> None:
        store = await open_store(store_url)
        script = [
            ModelResponse(text="[bold]calling[/]", tool_calls=(call("echo", "c[1]", text="[/]"),)),
            ModelResponse(text="done [/x] here :fire:", usage=Usage(model="vendor/[/oops]")),
        ]
        agent = Agent(name="m", model=ScriptedModel(script), tools=[echo])
        await InProcessRunner(agent, store).start("hi [/y] :thumbs_up:", thread_id="m:smile:[1]")
        await store.close()

    asyncio.run(run())
    shown = CliRunner().invoke(app, ["show", "m:smile:[1]", "--store", store_url])
    assert shown.exit_code == 0, shown.output
    shown_texts = (
        "hi [/y] :thumbs_up:",  # rich's emoji codes are not expanded either
        "[bold]calling[/]",
        "done [/x] here :fire:",
        "[red][/][/x]",
        "m:smile:[1]",
        "c[1]",
    )
    for text in (*shown_texts, "(vendor/[/oops])"):
        assert text in shown.output, text
    missing = CliRunner().invoke(app, ["show", "no-[/such]:smile:", "--store", store_url])
    assert missing.exit_code == 1 and "no-[/such]:smile:" in missing.output, missing.output


def test_show_and_watch_name_a_thread_pruned_through_its_head(tmp_path):
    """Only the frontier is kept: ``show`` said the thread had no commits and ``watch``
    waited for facts no store keeps."""
    store_url = f"sqlite:///{tmp_path}/pruned.db"

    async def run() -> None:
        store = await open_store(store_url)
        agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="hi")]))
        ended = await InProcessRunner(agent, store).start("go", thread_id="p-1")
        assert await store.prune(ThreadId("p-1"), ended.version) == ended.version
        await store.close()

    asyncio.run(run())
    shown = CliRunner().invoke(app, ["show", "p-1", "--store", store_url])
    assert shown.exit_code == 1 and "keeps no records: pruned through seq 2" in shown.output
    watched = CliRunner().invoke(app, ["watch", "p-1", "--store", store_url])
    assert watched.exit_code == 0 and "at rest" in watched.output, watched.output


def test_watch_names_a_wait_s_deadline_and_its_expiry(tmp_path):
    """Past its deadline a wait refuses an answer: ``watch`` suggested ``--approve or
    --deny`` alone, with no word of the deadline or of ``--expire``."""
    from tests.runtime.agents import answer_within_an_hour

    store_url = f"sqlite:///{tmp_path}/deadline.db"

    async def run() -> int:
        store = await open_store(store_url)
        script = [ModelResponse(tool_calls=(call("answer_within_an_hour", "c1", x=1),))]
        agent = Agent(name="a", model=ScriptedModel(script), tools=[answer_within_an_hour])
        parked = await InProcessRunner(agent, store).start("go", thread_id="d-1")
        await store.close()
        return parked.run_state.ticket.deadline_us

    deadline = asyncio.run(run())
    shown = CliRunner().invoke(app, ["watch", "d-1", "--store", store_url])
    assert shown.exit_code == 0, shown.output
    by = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(deadline // 10**6))
    assert f"--approve or --deny by {by} UTC, or after it: --expire" in shown.output


# ---- runs, show and watch for scripts: --json, filters, pages, whole ids ---------------

ALPHA, BETA = "tests.x:alpha", "tests.x:beta"
LONG_THREAD = "a-thread-id-[wider]-than-a-terminal-" + "0123456789abcdef" * 3 + "-end"
LONG_RUN = "run-[also]-" + "fedcba9876543210" * 2
MID_THREAD, MID_RUN = "demo-20240501T120000-89a7-01", "run-89a7f3c2d4e5"
"""Ids that fit 80 columns whole only if other columns give way."""
KINDS = ("natural", "awaiting", "failed")


@tool(needs_permission=True)
def drop(name: str) -> str:
    return f"dropped {name}"


def _refuse(request):
    raise ModelRefused("invalid_request", "no, thank you")


SCRIPTS = {
    "natural": [ModelResponse(text="fine, thanks")],
    "awaiting": [ModelResponse(text="may I?", tool_calls=(call("drop", "c1", name="t"),))],
    "failed": [_refuse],
}


def _threads() -> dict[str, tuple[str, str]]:
    """thread → (kind, agent reference), inserted in an order that is not the ids'."""
    order = (7, 2, 9, 0, 4, 1, 8, 3, 5, 6)
    made = {f"p-{i:02d}": (KINDS[i % 3], ALPHA if i % 2 else BETA) for i in order}
    made[LONG_THREAD] = ("natural", ALPHA)
    made[MID_THREAD] = ("failed", BETA)
    return made


THREADS = _threads()


@pytest.fixture(scope="module")
def listed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite store holding THREADS, their Runs started as a RunHost starts them."""
    url = f"sqlite:///{tmp_path_factory.mktemp('cli-list')}/list.db"

    async def fill() -> None:
        store = await open_store(url)
        for thread, (kind, ref) in THREADS.items():
            agent = Agent(name=kind, model=ScriptedModel(SCRIPTS[kind]), tools=[drop])
            run = RunId({LONG_THREAD: LONG_RUN, MID_THREAD: MID_RUN}.get(thread, f"run-{thread}"))
            engine = InProcessRunner(agent, store).engine()
            message = RunMeta(agent_ref=ref).message_id(run)
            await engine.start(ThreadId(thread), "go", run_id=run, message_id=message)
        await store.close()

    asyncio.run(fill())
    return url


def _cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in result.output, result.output
    return result


def _lines(result) -> list[dict]:
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout_bytes.decode("utf-8").splitlines()]


def _page_through(store: str, *args: str) -> list[list[str]]:
    """Every page of ``runs --json`` with ``args``: the thread ids of each."""
    pages, after = [], None
    while True:
        extra = ["--after", after] if after else []
        lines = _lines(_cli("runs", "--json", "--store", store, *args, *extra))
        assert lines[-1].keys() == {"next"}, lines[-1]
        pages.append([row["thread_id"] for row in lines[:-1]])
        after = lines[-1]["next"]
        if after is None:
            return pages


@pytest.mark.parametrize("limit", [1, 3, 50])
def test_pages_cover_every_thread_exactly_once_in_id_order(listed, limit):
    pages = _page_through(listed, "--limit", str(limit))
    assert all(0 < len(page) <= limit for page in pages), pages
    seen = [thread for page in pages for thread in page]
    assert seen == sorted(THREADS)


def test_filtered_pages_cover_exactly_the_matching_threads(listed):
    pages = _page_through(listed, "--agent", ALPHA, "--state", "ended", "--limit", "2")
    expected = sorted(
        t for t, (kind, ref) in THREADS.items() if ref == ALPHA and kind != "awaiting"
    )
    assert [t for page in pages for t in page] == expected and all(pages)


def test_runs_json_rows(listed):
    lines = _lines(_cli("runs", "--json", "--store", listed))
    rows = {row["thread_id"]: row for row in lines[:-1]}
    assert lines[-1] == {"next": None} and rows.keys() == THREADS.keys()
    for thread, row in rows.items():
        kind, ref = THREADS[thread]
        assert row["agent"] == ref and row["run_id"].startswith("run-")
        assert row["state"] == ("awaiting" if kind == "awaiting" else "ended")
        assert row["cause"] == {"natural": "natural", "failed": "failed", "awaiting": None}[kind]
        assert row["status"]["state"] == ("failed" if kind == "failed" else "idle")
        assert row["since"].endswith("+00:00") and row["steps"] == (0 if kind == "failed" else 1)
        assert row["usage"] is None and row["version"] >= 2


@pytest.mark.parametrize(
    ("args", "kinds"),
    [
        (["--state", "awaiting"], {"awaiting"}),
        (["--state", "ended"], {"natural", "failed"}),
        (["--status", "failed"], {"failed"}),
        (["--status", "idle"], {"natural", "awaiting"}),
        (["--failed"], {"failed"}),
        (["--failed", "--agent", BETA], {"failed"}),
    ],
)
def test_runs_filters(listed, args, kinds):
    agent = args[args.index("--agent") + 1] if "--agent" in args else None
    expected = {t for t, (kind, ref) in THREADS.items() if kind in kinds and agent in (None, ref)}
    lines = _lines(_cli("runs", "--json", "--store", listed, *args))
    assert {row["thread_id"] for row in lines[:-1]} == expected


def test_table_pages_print_their_cursor_last(listed):
    first = _cli("runs", "--store", listed, "--limit", "4")
    assert first.exit_code == 0, first.output
    last = first.output.strip().splitlines()[-1]
    assert last.startswith("next page: --after c1.")
    rest = _cli("runs", "--store", listed, "--after", last.split()[-1])
    assert rest.exit_code == 0 and "p-04" in rest.output and "p-00" not in rest.output
    assert "next page" not in rest.output


def _in_80_columns(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", "from cluster.cli import app; app()", "runs", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout
    return done.stdout


def test_ids_are_never_cut_in_80_columns(listed):
    fits = _in_80_columns("--store", listed, "--failed", "--agent", BETA)
    assert max(len(line) for line in fits.splitlines()) <= 80
    assert re.search(rf"│ {MID_THREAD} +│ {MID_RUN} +│", fits), fits
    wide = _in_80_columns("--store", listed)  # LONG_THREAD alone is wider than 80
    assert re.search(rf"│ {re.escape(LONG_THREAD)} +│ {re.escape(LONG_RUN)} +│", wide), wide
    for thread in set(THREADS) - {LONG_THREAD, MID_THREAD}:
        assert re.search(rf"│ {thread} +│ run-{thread} +│", wide), wide


def test_show_json_is_the_row_the_transcript_and_the_stored_commits(listed):
    thread = "p-01"  # awaiting a permission
    lines = _lines(_cli("show", thread, "--json", "--store", listed))
    head, rest = lines[0], lines[1:]
    assert head["type"] == "thread" and head["thread_id"] == thread and head["agent"] == ALPHA
    assert head["run_state"]["kind"] == "awaiting"
    assert head["run_state"]["ticket"]["target"]["wait"] == "permission"
    assert [s["state"] for s in head["status_history"]] == ["running", "idle"]
    assert head["history"]["commits"] == head["version"] and head["history"]["bytes"] > 0
    messages = [line for line in rest if line["type"] == "message"]
    commits = [line for line in rest if line["type"] == "commit"]
    assert [m["index"] for m in messages] == list(range(len(messages)))
    assert messages[0]["message"]["text"] == "go"
    assert [c["seq"] for c in commits] == list(range(1, head["version"] + 1))
    records = asyncio.run(_read(listed, thread))
    assert [ThreadCommit.model_validate(c["commit"]) for c in commits] == [
        r.commit for r in records
    ]


async def _read(url: str, thread: str):
    store = await open_store(url)
    try:
        return await store.read(ThreadId(thread))
    finally:
        await store.close()


def test_watch_json_prints_each_frame_then_from_an_offset(listed):
    frames = [
        Frame.model_validate(line)
        for line in _lines(_cli("watch", "p-00", "--json", "--store", listed))
    ]
    assert frames[0].type == "thread_status" and frames[0].offset is None
    offsets = [parse_offset(f.offset) for f in frames[1:]]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    assert isinstance(frames[-1].event, Fact) and frames[-1].event.type == "run_finished"
    middle = frames[len(frames) // 2].offset
    later = _lines(_cli("watch", "p-00", "--json", "--after", middle, "--store", listed))
    assert [line["offset"] for line in later[1:]] == [
        f.offset for f in frames[len(frames) // 2 + 1 :]
    ]
    # a cursor past the thread's last commit (another thread's) is bad input, one line
    past = _cli("watch", "p-00", "--after", "999:0", "--store", listed)
    assert past.exit_code == 1 and past.stdout == "", past.output
    assert "error: stream offset '999:0' is past the thread's last commit" in past.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--state", "idle"], "--state must be one of running, awaiting, ended, not 'idle'"),
        (["--status", "done"], "--status must be one of idle, running, failed, not 'done'"),
        (["--limit", "-1"], "--limit must be at least 1, not -1"),
        (["--limit", "0"], "--limit must be at least 1, not 0"),
        (["--after", "p-03"], "--after 'p-03' is not a cursor that ratchet runs printed"),
        (["--after", "c1.!!"], "is not a cursor"),
        (["--after", "c1.cC0wMw="], "is not a cursor"),  # padded: not as printed
        # ids no thread can have: a lone surrogate, a control character, ".", one past
        # the longest a store holds (STORED_ID_CHARS, 2,560: 2,561 x's)
        (["--after", "c1.7aCA"], "is not a cursor"),
        (["--after", "c1.AQ"], "is not a cursor"),
        (["--after", "c1.Lg"], "is not a cursor"),
        (["--after", "c1." + "eHh4" * 853 + "eHg"], "is not a cursor"),
        (["--failed", "--state", "running"], "--failed lists ended Runs"),
    ],
)
def test_bad_runs_input_is_one_line(listed, args, expected):
    result = _cli("runs", "--store", listed, "--json", *args)
    assert result.exit_code == 1 and result.stdout == "", result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]


def test_json_lines_are_utf8_even_with_lone_surrogates(capsysbinary):
    stored = {"text": "bytes \udcff\udc80 kept", "name": "café ☕", "big": 2**70}
    emit(stored)
    emit({"plain": "naïve"})
    out = capsysbinary.readouterr().out
    first, second = out.decode("utf-8").splitlines()  # strict: valid UTF-8
    assert json.loads(first) == stored and "\\udcff\\udc80" in first
    assert "café ☕" in first  # only the surrogates are escaped
    assert second == '{"plain":"naïve"}'


def test_a_reader_that_leaves_ends_the_command_quietly(listed):
    proc = subprocess.Popen(
        [sys.executable, "-c", "from cluster.cli import app; app()", "runs", "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "RATCHET_STORE_URL": listed},
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # long before it writes: it imports Ray first
    assert proc.wait(timeout=60) == 141
    assert proc.stderr.read() == b""


def test_serve_without_its_extra_says_which_to_install():
    """The first command of the README installs no web framework: ``ratchet serve`` then
    ended in a traceback of ``ModuleNotFoundError: uvicorn``."""
    no_uvicorn = "import sys; sys.modules['uvicorn'] = None; "
    done = _ratchet("serve", "--no-auth", "--any-agent", before=no_uvicorn)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "pip install -e '.[serve]'" in done.stderr
