"""Hostile input (DESIGN §10): fuzzed model output and hostile resume commands (bad input
at the edge of ``start`` is in test_settling.py). After each, the Run is at rest (never
left running), its log replays to the stored frontier, a failure has the expected kind
and code, and a model-visible tool error names the limit that was broken."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from runtime import (
    DEFAULT_LIMITS,
    Agent,
    Command,
    ExternalResult,
    InProcessRunner,
    InputRefused,
    Limits,
    ModelDelta,
    ModelResponse,
    PermissionDecision,
    ResumeCommand,
    ResumeRejected,
    ToolOutput,
    ToolResult,
    ToolResultMessage,
    ToolUse,
    UserInput,
    answer,
    tool,
)
from runtime.base import canonical_json
from runtime.commit import Frontier
from runtime.events import Delta, Fact
from runtime.ids import ThreadId
from runtime.lifecycle import DelegationOutcome, ScheduledFire, Unpause
from runtime.limits import (
    DOT_SEGMENTS,
    STORED_IDS,
    check_id,
    joined,
    json_depth,
    stored_size,
    utf8_problem,
)
from runtime.rules import replay
from storage.bus import EmbeddedBus
from storage.memory import MemoryCommitStore

MB = 1024 * 1024
FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Boom(Exception):
    """What a hostile model raises."""


class FuzzModel:
    """Step 0 (every attempt) yields what ``first`` gives; later Steps answer "done"."""

    def __init__(self, first: Callable[[int], Iterable[Any]]) -> None:
        self.first = first

    async def stream(self, request: Any) -> Any:
        if request.step > 0:
            yield ModelResponse(text="done")
            return
        for item in self.first(request.attempt):
            yield item


def answering(*items: Any) -> FuzzModel:
    return FuzzModel(lambda _attempt: items)


@tool
def echo(x: int = 0) -> str:
    return f"echo {x}"


def _raise() -> str:
    raise Boom("the tool broke")


def _state(value: Any) -> Callable[[], ToolResult]:
    return lambda: ToolResult(content="ok", commands=[Command(key="k", value=value)])


HOSTILE_TOOLS = [
    tool(lambda: "y" * (2 * MB), name="huge"),
    tool(_raise, name="broken"),
    tool(lambda: "half a pair: \udcff", name="surrogate"),
    tool(_state(json.loads("[" * 100 + "]" * 100)), name="deep_state"),
    tool(_state("z" * 70_000), name="big_state"),
]


@tool(wait="external_result")
def remote(q: str) -> str:
    return "never run here"


TOOLS = [echo, remote, *HOSTILE_TOOLS]


def runner(
    model: Any, store: Any, limits: Limits = DEFAULT_LIMITS, bus: Any = None, tools: Any = TOOLS
) -> Any:
    agent = Agent(name="a", model=model, tools=tools)
    return InProcessRunner(agent, store, limits=limits, bus=bus)


async def at_rest(store: Any, thread: str) -> Frontier:
    """The invariants of every case: at rest, and the log replays to the frontier."""
    frontier = await store.load(thread)
    assert frontier.run_state is not None and frontier.run_state.kind in ("ended", "awaiting")
    replayed = replay(frontier.thread_id, [r.commit for r in await store.read(thread)])
    skip = {"epoch", "owner"}
    assert replayed.model_dump(exclude=skip) == frontier.model_dump(exclude=skip)
    return frontier


async def drive(
    model: Any, limits: Limits = DEFAULT_LIMITS, bus: Any = None, tools: Any = TOOLS
) -> Frontier:
    store = MemoryCommitStore()
    await runner(model, store, limits, bus, tools).start("go", thread_id="t", run_id="r")
    return await at_rest(store, "t")


def cause(frontier: Frontier) -> tuple[str, ...]:
    c = frontier.run_state.cause  # type: ignore[union-attr]
    return (c.kind, c.failure, c.code) if c.kind == "failed" else (c.kind,)


def results(frontier: Frontier) -> list[ToolResultMessage]:
    return [m for m in frontier.messages if isinstance(m, ToolResultMessage)]


def one_call(arguments: str, name: str = "echo", call_id: str = "c1") -> FuzzModel:
    return answering(
        ModelResponse(tool_calls=(ToolUse(call_id=call_id, tool=name, arguments=arguments),))
    )


# ---- strategies ---------------------------------------------------------------------------

surrogates = st.characters(categories=["Cs"])
hostile_char = st.one_of(st.characters(), surrogates, st.sampled_from('\x00\n\x7f{}[]"\\é'))
hostile_text = st.lists(hostile_char, max_size=40).map("".join)  # st.text drops surrogates
hostile_id = st.one_of(
    st.just(""),
    st.text(st.sampled_from("abc"), min_size=1, max_size=3),
    hostile_text,
    st.integers(62, 66).map(lambda n: "i" * n),  # around the fuzz limit id_chars=64
)
SMALL = Limits(
    model_text_bytes=64,
    response_bytes=600,
    tool_calls=6,
    tool_arguments_bytes=200,
    json_depth=8,
    id_chars=64,
)


def nested(depth: int) -> str:
    return '{"x": ' * depth + "1" + "}" * depth


arguments = st.one_of(
    st.integers(-5, 5).map(lambda x: json.dumps({"x": x})),
    st.just("{}"),
    st.sampled_from(["", "[1, 2]", "nope", '{"x": "one"}', '{"x": 1', "null"]),
    hostile_text,
    st.integers(6, 11).map(nested),  # around the fuzz limit json_depth=8
    st.integers(190, 210).map(lambda n: '{"x": 1, "pad": "' + "p" * (n - 22) + '"}'),
)
calls = st.builds(
    ToolUse,
    call_id=hostile_id,
    tool=st.one_of(st.sampled_from(["echo", "echo", "echo", "nope"]), hostile_text),
    arguments=arguments,
)


# ---- 1. model output --------------------------------------------------------------------


@FUZZ
@given(deltas=st.lists(hostile_text, max_size=4), text=hostile_text)
def test_fuzzed_answer_text_is_committed_or_fails_the_inference(deltas, text):
    items = [*(ModelDelta(text=d) for d in deltas), ModelResponse(text=text)]
    frontier = asyncio.run(drive(answering(*items), SMALL, bus=EmbeddedBus()))
    if utf8_problem(text) is not None:
        assert cause(frontier) == ("failed", "inference", "utf8")
    elif stored_size(text) > SMALL.model_text_bytes:
        assert cause(frontier) == ("failed", "inference", "model_text_bytes")
    else:
        assert cause(frontier) == ("natural",) and frontier.messages[-1].text == text


class Recording(EmbeddedBus):
    """The embedded bus, keeping every delta it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.deltas: list[Delta] = []

    async def publish(self, thread: ThreadId, events: Sequence[Fact | Delta]) -> None:
        self.deltas.extend(e for e in events if isinstance(e, Delta))
        await super().publish(thread, events)


@FUZZ
@given(deltas=st.lists(hostile_text, max_size=5))
def test_live_deltas_are_whole_text_with_a_cut_character_carried_over(deltas):
    """What a follower gets live is valid Unicode, whatever the provider sent: a Redis bus
    or an SSE stream could not encode a lone half. A character cut between two chunks
    travels whole with the second; a half with no partner is U+FFFD."""
    bus = Recording()
    items = [*(ModelDelta(text=d) for d in deltas), ModelResponse(text="ok")]
    asyncio.run(drive(answering(*items), SMALL, bus=bus))
    live = [d.text for d in bus.deltas]
    assert all(utf8_problem(t) is None for t in live)
    sent = joined(deltas)
    if utf8_problem(sent) is None:
        assert "".join(live) == sent
    else:
        whole = sent.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        assert "".join(live) == whole.removesuffix("\ufffd") or "".join(live) == whole


@given(parts=st.lists(hostile_text, max_size=4))
def test_joined_fragments_pair_every_adjacent_half_and_keep_their_code_units(parts):
    """``joined`` (a stream's fragments as one text) changes no UTF-16 code unit: it
    only makes adjacent halves of a pair the character they encode; a half left alone
    has no partner beside it, and stays for ``utf8_problem`` to refuse."""
    text = joined(parts)
    as_utf16 = "".join(parts).encode("utf-16-le", "surrogatepass")
    assert text.encode("utf-16-le", "surrogatepass") == as_utf16
    assert not re.search("[\ud800-\udbff][\udc00-\udfff]", text)
    if utf8_problem("".join(parts)) is None:
        assert text == "".join(parts)


def expected_error(use: ToolUse, limits: Limits) -> str | None:
    """What the model must be told about this call: the limit it broke (None: it ran)."""
    if utf8_problem(use.arguments) is not None:
        return "unpaired surrogate"
    if stored_size(use.arguments) > limits.tool_arguments_bytes:
        return "tool_arguments_bytes"
    if use.tool != "echo":
        return "unknown tool"
    if json_depth(use.arguments) > limits.json_depth:
        return "json_depth"
    try:
        echo.parse(use.arguments, limits)
    except ValueError as exc:
        return str(exc)
    return None


@FUZZ
@given(uses=st.lists(calls, max_size=8))
def test_fuzzed_tool_calls_become_results_or_model_visible_errors(uses):
    model = answering(ModelResponse(text="t", tool_calls=tuple(uses)))
    frontier = asyncio.run(drive(model, SMALL, tools=[echo]))
    if 1 + sum(stored_size(u.arguments) for u in uses) > SMALL.response_bytes:
        assert cause(frontier) == ("failed", "inference", "response_bytes")
        return
    if len(uses) > SMALL.tool_calls:
        assert cause(frontier) == ("failed", "inference", "tool_calls")
        return
    assert cause(frontier) == ("natural",)
    if not uses:
        return
    committed = frontier.messages[1].tool_calls
    ids = [c.call_id for c in committed]
    assert len(set(ids)) == len(ids) == len(uses)
    got = results(frontier)
    assert [r.call_id for r in got] == ids
    for original, stored, result in zip(uses, committed, got, strict=True):
        assert stored.call_id and utf8_problem(stored.call_id) is None
        assert utf8_problem(stored.tool) is None and len(stored.tool) <= SMALL.id_chars
        assert result.tool == stored.tool
        why = expected_error(original, SMALL)
        event(f"{why}"[:30])
        if why is None:
            x = json.loads(original.arguments or "{}").get("x", 0)
            assert not result.is_error and result.content == f"echo {x}"
        else:
            assert result.is_error and why in result.content, (why, result.content)
        if why in ("unpaired surrogate", "tool_arguments_bytes"):
            assert stored.arguments == "{}"


JUNK_RESPONSES = (
    ModelResponse.model_construct(text=None),
    ModelResponse.model_construct(text="x", tool_calls=[{"call_id": "c"}]),
    ModelResponse.model_construct(
        text="", tool_calls=(ToolUse.model_construct(call_id=7, tool=None, arguments=b"{}"),)
    ),
)
junk = st.one_of(
    st.builds(ModelDelta, text=hostile_text),
    st.builds(ModelResponse, text=st.text(max_size=10)),
    st.sampled_from([42, None, "a bare string", {"text": "a dict"}, Boom("yielded, not raised")]),
    st.sampled_from(JUNK_RESPONSES),
)


@FUZZ
@given(items=st.lists(junk, max_size=6), raises=st.booleans(), bus=st.booleans())
def test_a_model_yielding_junk_or_raising_leaves_the_run_at_rest(items, raises, bus):
    def first(_attempt: int) -> Iterable[Any]:
        yield from items
        if raises:
            raise Boom("model failed")

    frontier = asyncio.run(drive(FuzzModel(first), bus=EmbeddedBus() if bus else None))
    # an item that is neither a delta nor a response is named, listener or not (without
    # one it was passed over, and the attempt said it ended without a response)
    streamed = all(isinstance(i, ModelDelta | ModelResponse) for i in items)
    responses = [i for i in items if isinstance(i, ModelResponse)]
    if not streamed:
        assert cause(frontier) == ("failed", "inference", "TypeError")
    elif raises:
        assert cause(frontier) == ("failed", "inference", "Boom")
    elif not responses:
        assert cause(frontier) == ("failed", "inference", "RuntimeError")
    elif any(responses[-1] is j for j in JUNK_RESPONSES):
        assert cause(frontier)[:2] == ("failed", "inference")
    else:
        assert cause(frontier) == ("natural",)
        assert frontier.messages[-1].text == responses[-1].text


def streamed_calls(calls: list[tuple[str, str]]) -> list[ModelDelta | ModelResponse]:
    """Each call (id, tool) streamed as one delta of ``{}``, then the response of them."""
    deltas = [ModelDelta(type="tool_call_delta", text="{}", call_id=c, tool=t) for c, t in calls]
    uses = tuple(ToolUse(call_id=c, tool=t, arguments="{}") for c, t in calls)
    return [*deltas, ModelResponse(tool_calls=uses)]


@pytest.mark.parametrize(
    ("first", "want"),
    [
        (
            lambda a: [ModelResponse(text="x" * (2 * MB))],
            ("failed", "inference", "model_text_bytes"),
        ),
        (lambda a: [ModelDelta(text="no answer follows")], ("failed", "inference", "RuntimeError")),
        (lambda a: [], ("failed", "inference", "RuntimeError")),
        (lambda a: (_ for _ in ()).throw(Boom("down")), ("failed", "inference", "Boom")),
        # the first attempt fails, the second answers: the Run goes on
        (lambda a: [ModelResponse(text="\udcff" if a == 1 else "fine")], ("natural",)),
        # a stream that never ends is cut at the response limit, not followed for ever
        (
            lambda a: itertools.repeat(ModelDelta(text="x" * 1000)),
            ("failed", "inference", "response_bytes"),
        ),
        # endless empty deltas (pings) are cut too: each item counts
        (
            lambda a: itertools.repeat(ModelDelta(text="")),
            ("failed", "inference", "response_bytes"),
        ),
        # reasoning is not the response: long thinking, then a short answer, is an answer
        (
            lambda a: [
                *(ModelDelta(type="reasoning_delta", text="hmm " * 250) for _ in range(200)),
                ModelResponse(text="It is 5."),
            ],
            ("natural",),
        ),
        # and reasoning without end is cut at its own bound
        (
            lambda a: itertools.repeat(ModelDelta(type="reasoning_delta", text="hmm " * 250)),
            ("failed", "inference", "reasoning_bytes"),
        ),
        # calls past the limit are refused as they stream, not once the last one came
        (
            lambda a: (
                ModelDelta(type="tool_call_delta", text="{}", call_id=f"c{i}", tool="echo")
                for i in itertools.count()
            ),
            ("failed", "inference", "tool_calls"),
        ),
        # a call's id and tool name are streamed text too: 64 calls of 64 KiB ids each (4
        # MiB, held, checkpointed and live until the response was renamed at its end)
        (
            lambda a: streamed_calls([(f"{i}" * 65536, "echo") for i in range(64)]),
            ("failed", "inference", "response_bytes"),
        ),
        (
            lambda a: streamed_calls([("c1", "e" * MB)]),
            ("failed", "inference", "response_bytes"),
        ),
    ],
    ids=[
        "2MB-answer",
        "no-response",
        "empty-stream",
        "raises",
        "retried",
        "endless-stream",
        "endless-pings",
        "long-reasoning",
        "endless-reasoning",
        "endless-calls",
        "megabytes-of-call-ids",
        "a-megabyte-tool-name",
    ],
)
async def test_model_failures_end_the_run_failed_inference(first, want):
    assert cause(await drive(FuzzModel(first))) == want


async def test_thousands_of_tool_calls_fail_the_inference_but_the_limit_itself_runs():
    many = tuple(ToolUse(call_id=f"c{i}", tool="echo", arguments="{}") for i in range(5000))
    frontier = await drive(answering(ModelResponse(tool_calls=many)))
    assert cause(frontier) == ("failed", "inference", "tool_calls")
    frontier = await drive(answering(ModelResponse(tool_calls=many[: DEFAULT_LIMITS.tool_calls])))
    assert cause(frontier) == ("natural",)
    assert [r.content for r in results(frontier)] == ["echo 0"] * DEFAULT_LIMITS.tool_calls


def args_of(size: int) -> str:
    return '{"x": "' + "a" * (size - 9) + '"}'


@pytest.mark.parametrize(
    ("arguments", "name", "limit"),
    [
        ("[" * 5000 + "]" * 5000, "echo", "json_depth"),
        ('{"a":' * 3000 + "1" + "}" * 3000, "echo", "json_depth"),
        (args_of(DEFAULT_LIMITS.tool_arguments_bytes + 1), "echo", "tool_arguments_bytes"),
        ('{"x": "\udcff"}', "echo", "unpaired surrogate"),
        ("{not json", "echo", "not valid JSON"),
        ("[1]", "echo", "must be a JSON object"),
        ("{}", "\udcffecho", "unknown tool"),
        ("{}", "ec\x00ho", "unknown tool"),
        # valid JSON whose value no tool can take: an MCP session died sending one
        ('{"x": "\\ud800"}', "echo", "utf8"),
        ('{"x": NaN}', "echo", "NaN"),
        ('{"x": 1e400}', "echo", "NaN"),
        # a key twice: the tool ran with the last value, the committed text held both
        ('{"x": "a", "x": "b"}', "echo", "appears twice"),
    ],
    ids=["5000-deep-array", "3000-deep-object", "over-the-limit", "surrogate", "not-json",
         "not-object", "surrogate-tool", "control-char-tool", "escaped-surrogate", "nan",
         "overflowing-float", "repeated-key"],
)  # fmt: skip
async def test_bad_arguments_are_a_model_visible_error_naming_the_limit(arguments, name, limit):
    frontier = await drive(one_call(arguments, name))
    assert cause(frontier) == ("natural",)
    (result,) = results(frontier)
    assert result.is_error and limit in result.content
    stored = frontier.messages[1].tool_calls[0]
    assert len(stored.arguments) <= DEFAULT_LIMITS.tool_arguments_bytes
    check_id("tool", stored.tool)  # a name that names no tool is still stored as an id


@pytest.mark.parametrize("size", [MB, 20 * MB])
async def test_arguments_over_the_whole_response_limit_fail_the_inference(size):
    frontier = await drive(one_call(args_of(size)))
    assert cause(frontier) == ("failed", "inference", "response_bytes")
    assert len(frontier.model_dump_json()) < 10_000  # none of it was committed


@pytest.mark.parametrize(
    ("name", "limit"),
    [
        ("huge", "tool_result_bytes"),
        ("surrogate", "utf8"),
        ("broken", "Boom: the tool broke"),
        ("deep_state", "json_depth"),
        ("big_state", "state_value_bytes"),
    ],
)
async def test_bad_tool_results_are_a_model_visible_error_naming_the_limit(name, limit):
    frontier = await drive(one_call("{}", name))
    assert cause(frontier) == ("natural",)
    (result,) = results(frontier)
    assert result.is_error and limit in result.content
    assert "k" not in frontier.state["thread"]  # refused commands are dropped


async def test_text_is_measured_as_stored_so_escaped_output_cannot_overflow_a_commit():
    """A control character takes 6 bytes as stored, a quote 2: the limits count those,
    so output made of them at every limit still fits the default payload limit."""
    limit = DEFAULT_LIMITS
    frontier = await drive(answering(ModelResponse(text="\x01" * limit.model_text_bytes)))
    assert cause(frontier) == ("failed", "inference", "model_text_bytes")
    nuls = tool(lambda q: "\x00" * (limit.tool_result_bytes // 6), name="nuls")
    uses = tuple(
        ToolUse(call_id=f"c{i}", tool="nuls", arguments='{"q": "' + '\\"' * 250 + '"}')
        for i in range(limit.tool_calls)
    )
    text = '"' * (limit.model_text_bytes // 4)
    frontier = await drive(answering(ModelResponse(text=text, tool_calls=uses)), tools=[nuls])
    assert cause(frontier) == ("natural",)
    done = [r for r in results(frontier) if not r.is_error]
    assert len(done) == limit.batch_result_bytes // stored_size(done[0].content)
    assert all("batch_result_bytes" in r.content for r in results(frontier) if r.is_error)


async def test_duplicate_and_empty_call_ids_are_made_unique_and_every_call_runs():
    ids = ["a", "a", "", "", "call-3", "a#2", "\udcff", "a"]
    uses = tuple(
        ToolUse(call_id=i, tool="echo", arguments=f'{{"x": {n}}}') for n, i in enumerate(ids)
    )
    frontier = await drive(answering(ModelResponse(tool_calls=uses)))
    stored = [c.call_id for c in frontier.messages[1].tool_calls]
    assert len(set(stored)) == len(ids) and stored[:2] == ["a", "a#2"]
    assert [r.content for r in results(frontier)] == [f"echo {n}" for n in range(len(ids))]


async def test_a_renamed_repeat_of_a_longest_call_id_can_still_be_resumed():
    @tool(needs_permission=True)
    def risky() -> str:
        return "ran"

    longest = "x" * DEFAULT_LIMITS.id_chars
    uses = tuple(ToolUse(call_id=longest, tool="risky", arguments="{}") for _ in range(2))
    store = MemoryCommitStore()
    run = InProcessRunner(
        Agent(name="a", model=answering(ModelResponse(tool_calls=uses)), tools=[risky]), store
    )
    frontier = await run.start("go", thread_id="t")
    for _ in uses:  # each call waits for permission in turn
        frontier = await run.resume(
            answer(frontier.run_state.ticket, PermissionDecision(approve=True))
        )
    assert cause(frontier) == ("natural",)


# ---- 2. resume commands -----------------------------------------------------------------

RESUME_LIMITS = Limits(tool_result_bytes=64, resume_payload_bytes=160, input_bytes=64, id_chars=64)


async def awaiting_run(store: Any, limits: Limits = RESUME_LIMITS) -> tuple[Any, Frontier]:
    run = runner(one_call('{"q": "?"}', "remote", "c"), store, limits)
    frontier = await run.start("go", thread_id="t", run_id="r")
    assert frontier.run_state.kind == "awaiting"
    return run, frontier


def content(n: int) -> st.SearchStrategy[str]:
    return st.one_of(hostile_text, st.integers(n - 4, n + 4).map(lambda k: "c" * k))


payloads = st.one_of(
    st.builds(
        ExternalResult, output=st.builds(ToolOutput, content=content(64), is_error=st.booleans())
    ),
    st.builds(PermissionDecision, approve=st.booleans(), note=hostile_text),
    st.builds(UserInput, text=content(64)),
    st.builds(DelegationOutcome, output=st.builds(ToolOutput, content=hostile_text)),
    st.just(ScheduledFire()),
    st.just(Unpause()),
)


stored_id = st.one_of(  # a ticket's ids: around what a store holds (``STORED_IDS``)
    hostile_id, st.integers(-1, 1).map(lambda d: "i" * (STORED_IDS.id_chars + d))
)
HOSTILE_FIELDS = {
    "correlation": hostile_id,
    "run_id": stored_id,
    "thread_id": st.one_of(st.just("other"), stored_id),
    "call_id": st.one_of(st.none(), stored_id),
    "payload": payloads,
}


def bad(text: str | None, most: int, *, is_id: bool = False) -> bool:
    """Refused at the edge: unstorable, over ``most`` (ids: characters, else UTF-8 bytes)."""
    if text is None:
        return False
    size = len(text) if is_id else stored_size(text)
    control = is_id and (not text or re.search(r"[\x00-\x1f\x7f-\x9f]", text) is not None)
    path_step = is_id and text in DOT_SEGMENTS  # "." and "..": no URL could address them
    return utf8_problem(text) is not None or size > most or control or path_step


def refused_at_the_edge(command: ResumeCommand, limits: Limits) -> bool:
    most = STORED_IDS.id_chars  # a ticket's ids name what is stored, whatever id_chars is
    ids = [(command.correlation, 4 * most)]
    ids += [(i, most) for i in (command.run_id, command.thread_id, command.call_id)]
    payload = command.payload.model_dump(mode="python")
    texts = [
        ((payload.get("output") or {}).get("content"), limits.tool_result_bytes),
        (payload.get("text"), limits.input_bytes),
        (payload.get("note"), limits.resume_payload_bytes),
    ]
    return (
        any(bad(i, n, is_id=True) for i, n in ids)
        or any(bad(t, n) for t, n in texts)
        or (  # a user input is its text (input_bytes), as a Run's input is
            payload.get("kind") != "user_input"
            and stored_size(canonical_json(payload)) > limits.resume_payload_bytes
        )
    )


@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_hostile_resume_commands_are_refused_and_the_ticket_stays(data):
    async def case() -> None:
        store = MemoryCommitStore()
        run, before = await awaiting_run(store)
        ticket = before.run_state.ticket
        good = answer(ticket, ExternalResult(output=ToolOutput(content="the answer")))
        broken = data.draw(st.sets(st.sampled_from(sorted(HOSTILE_FIELDS)), max_size=2))
        command = good.model_copy(update={f: data.draw(HOSTILE_FIELDS[f]) for f in broken})
        assume(command != good)
        edge = refused_at_the_edge(command, RESUME_LIMITS)
        same_ids = command.model_copy(update={"payload": good.payload}) == good
        fits = same_ids and isinstance(command.payload, ExternalResult)
        try:
            await run.resume(command)
        except InputRefused as exc:
            event(f"refused: {exc.limit}")
            assert edge
        except ResumeRejected as exc:
            event(f"rejected: {exc.axis}")
            assert not edge and not fits
        else:
            event("accepted")
            assert not edge and fits  # another valid external result: it is the answer
            done = await at_rest(store, "t")
            assert cause(done) == ("natural",)
            assert results(done)[0].content == command.payload.output.content
            return
        after = await at_rest(store, "t")
        assert after == before  # the ticket, the version, everything as it was
        done = await run.resume(good)
        assert cause(done) == ("natural",) and results(done)[0].content == "the answer"

    asyncio.run(case())


async def test_deep_nesting_in_a_resume_payload_is_refused():
    store = MemoryCommitStore()
    run, before = await awaiting_run(store, DEFAULT_LIMITS)
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    # ToolOutput.content is text: deep JSON can only be put there past pydantic's
    # validation, which the resume does again (``Given``)
    payload = ExternalResult.model_construct(output=ToolOutput.model_construct(content=deep))
    command = answer(before.run_state.ticket, ExternalResult(output=ToolOutput(content="x")))
    hostile = command.model_copy(update={"payload": payload})
    with pytest.raises(InputRefused) as refused:
        await run.resume(hostile)
    assert refused.value.limit == "type" and await at_rest(store, "t") == before
    # as text, deep brackets are only text: within tool_result_bytes they are the answer
    text = "[" * 5000 + "]" * 5000
    done = await run.resume(
        answer(before.run_state.ticket, ExternalResult(output=ToolOutput(content=text)))
    )
    assert results(done)[0].content == text


@tool(needs_permission=True)
def guarded_echo() -> str:
    return "ran"


async def test_results_a_resume_supplies_are_held_to_the_result_limits():
    """A denial's note and a caller's external result become the call's result: over
    ``tool_result_bytes``, or past the Step's ``batch_result_bytes``, they are a
    model-visible error, as a tool's own result would be."""
    limits = Limits(tool_result_bytes=64, batch_result_bytes=40, resume_payload_bytes=400)
    both = ModelResponse(
        tool_calls=(
            ToolUse(call_id="e", tool="echo", arguments="{}"),
            ToolUse(call_id="c", tool="remote", arguments='{"q": "?"}'),
        )
    )
    store = MemoryCommitStore()
    run = runner(answering(both), store, limits)
    waiting = await run.start("go", thread_id="t", run_id="r")
    done = await run.resume(
        answer(waiting.run_state.ticket, ExternalResult(output=ToolOutput(content="x" * 60)))
    )
    echoed, remote_result = results(done)
    assert not echoed.is_error and remote_result.is_error
    assert "batch_result_bytes" in remote_result.content
    store = MemoryCommitStore()
    run = runner(one_call("{}", "guarded_echo"), store, limits, tools=[guarded_echo])
    waiting = await run.start("go", thread_id="t", run_id="r")
    done = await run.resume(
        answer(waiting.run_state.ticket, PermissionDecision(approve=False, note="n" * 200))
    )
    (denied,) = results(done)
    assert denied.is_error and "tool_result_bytes" in denied.content
    await at_rest(store, "t")


@given(
    st.recursive(
        st.none() | st.text() | st.integers(),
        lambda kids: (
            st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=3)
        ),
        max_leaves=30,
    )
)
@example("[")  # one bracket, in a string: it opens nothing (a count said 1)
@example(["{"])
def test_json_depth_counts_what_json_nests_whatever_its_strings_hold(value: Any) -> None:
    """Brackets, quotes and backslashes inside strings are text, not nesting."""

    def nesting(v: Any) -> int:
        if isinstance(v, list | dict):
            kids = v.values() if isinstance(v, dict) else v
            return 1 + max((nesting(k) for k in kids), default=0)
        return 0

    assert json_depth(json.dumps(value)) == nesting(value)


def test_json_depth_of_unterminated_strings_and_the_limits_ceiling() -> None:
    """One pass whatever the text: a string that never ends swallows what follows it (the
    regex of whole strings it replaced rescanned from each quote: quadratic), and no
    Limits may allow nesting a stored record could not decode again."""
    from runtime.limits import MAX_JSON_DEPTH, Limits

    assert json_depth("[" * 70 + '"' + '\\"[' * 10_000) == 70
    assert json_depth('[["\\\\", [[]]]]') == 4
    with pytest.raises(ValueError, match="json_depth is at most"):
        Limits(json_depth=MAX_JSON_DEPTH + 1)
    assert Limits(json_depth=MAX_JSON_DEPTH).json_depth == MAX_JSON_DEPTH


async def test_id_chars_has_a_floor_and_counts_in_the_largest_commit() -> None:
    """``id_chars=30`` refused the thread ids the runner makes itself (39 characters) to
    a caller that gave none; and the largest commit the limits allow left ids out: a
    Step of calls with 100,000-character ids made a commit of 6 MB, past the bound the
    store was checked against."""
    from runtime.limits import MIN_ID_CHARS, Limits

    with pytest.raises(ValueError, match="id_chars is at least 64"):
        Limits(id_chars=MIN_ID_CHARS - 1)
    run = runner(one_call("{}", "remote", "c"), MemoryCommitStore(), Limits(id_chars=MIN_ID_CHARS))
    await run.start("go")  # ids of its own making
    long_ids = Limits(id_chars=200_000)
    assert long_ids.commit_bytes() > long_ids.tool_calls * 3 * long_ids.id_chars
