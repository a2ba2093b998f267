"""@tool, the import boundary of runtime/, and the curated public surface."""

from __future__ import annotations

import ast
import datetime
import decimal
import enum
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, field_validator
from pydantic.alias_generators import to_camel

import runtime
from runtime import ToolContext, ToolDefinitionError, tool
from runtime.ids import CallId, OperationId, RunId, ThreadId
from runtime.ports import ToolInvocation
from runtime.tools import Tool


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


def _imports(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of the package it depends on: its
    module-level imports, those for type checking included (a helper typed with the
    Engine depends on it as much as one that imports it); an import inside a function
    is a deliberate lazy one and not counted."""
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        statements = list(ast.parse(path.read_text()).body)
        found: set[str] = set()
        while statements:
            node = statements.pop()
            if isinstance(node, ast.If | ast.Try):
                statements.extend([*node.body, *node.orelse])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                f"{package.name}."
            ):
                found.add(str(node.module))
        graph[f"{package.name}.{path.stem}"] = found
    return graph


@pytest.mark.parametrize("package", ["runtime", "storage", "actors", "cluster"])
def test_no_import_circles(package: str):
    graph = _imports(Path(__file__).resolve().parents[2] / package)
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join((*path, module)))
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_exports_match_all():
    exported = set(runtime.__all__)
    public = {name for name in dir(runtime) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(runtime, name)).__name__ == "module"}
    assert exported == public - modules
    assert len(runtime.__all__) == len(exported)


def test_errors_cross_process_boundaries_as_their_own_type():
    import pickle

    from runtime.errors import CorruptRecord, Fenced, ResumeRejected, VersionConflict

    for error in (
        VersionConflict("t", 1, 2),
        Fenced("t", 1, 3),
        CorruptRecord("t", 4, "bad"),
        ResumeRejected("payload", "expected permission"),
    ):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert vars(copy) == vars(error)


async def test_a_rejected_resume_does_not_claim_the_thread():
    from runtime import (
        Agent,
        InProcessRunner,
        ModelResponse,
        ResumeCommand,
        ResumeRejected,
        ScriptedModel,
        UserInput,
        call,
    )
    from storage.memory import MemoryCommitStore

    @tool(needs_permission=True)
    def risky() -> str:
        return "ran"

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("risky", "c"),)), ModelResponse(text="k")]
    )
    store = MemoryCommitStore()
    runner = InProcessRunner(Agent(name="a", model=model, tools=[risky]), store)
    f = await runner.start("go", thread_id="t")
    epoch = f.epoch
    ticket = f.run_state.ticket
    bad = ResumeCommand(
        correlation=ticket.correlation,
        run_id=ticket.run_id,
        thread_id=ticket.thread_id,
        payload=UserInput(text="x"),
    )
    with pytest.raises(ResumeRejected):
        await runner.resume(bad)
    assert (await store.load("t")).epoch == epoch


class _Color(enum.Enum):
    red = "red"


class _Point(BaseModel):
    x: int
    y: int


SEEN_ARGS: dict[str, object] = {}


@tool
def book(
    when: datetime.datetime, price: decimal.Decimal, color: _Color, p: _Point, ids: tuple[int, ...]
) -> str:
    SEEN_ARGS.update(when=when, price=price, color=color, p=p, ids=ids)
    return f"booked {when.isoformat()} at {price + 1} in {color.value} at {p.x},{p.y}"


@tool
def weigh(kilos: float) -> str:
    return f"{kilos} kg"


def _parsed_call(t: Tool, raw: dict[str, object]) -> ToolInvocation:
    """One call of ``t`` with the model's arguments ``raw``, parsed as its gate parses them."""
    return ToolInvocation(
        tool=t.id,
        arguments=t.parse(json.dumps(raw)),
        call_id=CallId("c1"),
        operation_id=OperationId("op"),
        attempt=1,
        run_id=RunId("r"),
        thread_id=ThreadId("t"),
    )


async def test_a_tool_gets_its_arguments_as_its_parameters_are_typed():
    """Arguments travel as JSON; the tool gets a datetime, a Decimal, an Enum, a model and
    a tuple as its signature says, not their JSON forms (str, dict, list)."""
    from runtime.ports import Finished
    from runtime.tool_calls import LocalToolRunner

    raw = {"when": "2025-01-02T03:04:05Z", "price": "9.99", "color": "red",
           "p": {"x": 1, "y": 2}, "ids": [1, 2]}  # fmt: skip
    (outcome,) = await LocalToolRunner([book]).run([_parsed_call(book, raw)])
    assert isinstance(outcome, Finished) and not outcome.output.is_error, outcome
    assert {
        "when": datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
        "price": decimal.Decimal("9.99"),
        "color": _Color.red,
        "p": _Point(x=1, y=2),
        "ids": (1, 2),
    } == SEEN_ARGS
    with pytest.raises(ValueError, match="finite"):
        weigh.parse('{"kilos": "nan"}')  # no JSON holds a NaN: refused, never passed on


def test_a_tool_s_schema_cannot_be_changed_in_place():
    """Every request shares the cached schema: a model or an adapter changing a part of it
    would change what every later request (of every Run) tells the model."""
    schema = weigh.schema()
    with pytest.raises(TypeError):
        schema["parameters"]["properties"]["kilos"]["type"] = "string"
    with pytest.raises(TypeError):
        schema["parameters"]["required"].append("x")
    assert weigh.schema()["parameters"]["properties"]["kilos"]["type"] == "number"


def test_settings_that_cannot_work_are_refused_when_built():
    from runtime import Agent, ModelResponse, ScriptedModel, ToolDefinitionError

    model = ScriptedModel([ModelResponse(text="x")])
    for bad in ({"inference_attempts": 0}, {"max_steps": 0}, {"inference_timeout_s": 0},
                {"inference_timeout_s": float("nan")}, {"rate_limit_wait_s": -1}):  # fmt: skip
        with pytest.raises(ValueError):
            Agent(name="a", model=model, **bad)  # type: ignore[arg-type]
    for timeout in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ToolDefinitionError, match="timeout_s"):
            tool(timeout_s=timeout, name="x")(lambda: "x")
        # a wait deadline that can never be met (or never stored) fails at import, not at a resume
        with pytest.raises(ToolDefinitionError, match="wait_deadline_s"):
            tool(needs_permission=True, wait_deadline_s=timeout, name="x")(lambda: "x")
    # a deadline on a tool that never waits would be ignored without a word
    with pytest.raises(ToolDefinitionError, match="bounds a wait"):
        tool(wait_deadline_s=5, name="x")(lambda: "x")
    assert (
        tool(wait="external_result", wait_deadline_s=5, name="x")(lambda: "x").wait_deadline_s == 5
    )


def test_a_tool_cannot_declare_the_runtime_s_delegation_wait():
    """``awaiting(delegation)`` is the wait of a delegating call whose lone child waits,
    answered only by that child's end. A tool that declared it waited for a child it
    never had: every answer was refused (no child; with a deadline, "the deadline has
    passed") and so was its expiry ("a delegation's wait does not expire"), and only a
    cancel ended the Run. Refused when the tool is built, or the agent made with it."""
    from dataclasses import replace

    from runtime import Agent, ModelResponse, ScriptedModel

    for deadline in (None, 5):
        with pytest.raises(ToolDefinitionError, match="delegation"):
            tool(wait="delegation", wait_deadline_s=deadline, name="x")(lambda: "x")
    changed = replace(tool(wait="external_result", name="x")(lambda: "x"), wait="delegation")
    with pytest.raises(ToolDefinitionError, match="delegation"):
        Agent(name="a", model=ScriptedModel([ModelResponse(text="x")]), tools=[changed])


def test_an_agent_s_parts_of_the_wrong_kind_are_refused_when_it_is_made():
    """Each was accepted and ended every Run ``failed(internal)`` at its first use (a bug
    of Ratchet's, it said); a recovery policy built with ``model_construct`` was pinned
    into the batch as it was, and committed into a record no read decodes."""
    from runtime import Agent, ModelResponse, ScriptedModel, ToolDefinitionError
    from runtime.agent import SessionSide
    from runtime.batch import ToolRecoveryPolicy

    def agent(**parts):
        return Agent(name="a", model=ScriptedModel([ModelResponse(text="x")]), **parts)

    construct = ToolRecoveryPolicy.model_construct
    for parts, error in [
        ({"hooks": [lambda h: None]}, TypeError),
        ({"tools": ["weigh"]}, ToolDefinitionError),
        ({"gates": ["no"]}, TypeError),
        ({"policies": None}, ToolDefinitionError),
        ({"policies": {"weigh": "replay_safe"}}, ToolDefinitionError),
        ({"policies": {"weigh": construct(mode="bogus", max_attempts=3)}}, ToolDefinitionError),
        (
            {"policies": {"weigh": construct(mode="never_replay", max_attempts=0)}},
            ToolDefinitionError,
        ),
    ]:
        with pytest.raises(error):
            agent(**parts)
    for model in ("gpt-4", None):  # every Run's inference failed AttributeError, twice
        with pytest.raises(TypeError, match="a model has a stream"):
            Agent(name="a", model=model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hooks is a sequence"):
        agent(hooks=None)
    kept = agent(policies={"weigh": {"mode": "replay_safe"}}).policies["weigh"]
    assert kept == ToolRecoveryPolicy(mode="replay_safe")
    for side in ({"human": 5}, {"handler": "no"}, {"agent": "a:b"}):
        with pytest.raises(TypeError, match="a session side's"):
            SessionSide(**side)
    with pytest.raises(ToolDefinitionError, match="wait is one of"):
        tool(wait="bogus")(lambda: "x")
    for seconds in (1e308, 10**5000, 10**9 + 1):  # overflowed making a deadline, or repr()
        with pytest.raises(ToolDefinitionError, match="up to 1000000000"):
            tool(timeout_s=seconds, name="x")(lambda: "x")
    assert tool(timeout_s=10**9, name="x")(lambda: "x").timeout_s == 10**9
    import dataclasses

    waits = tool(wait="external_result", wait_deadline_s=5, name="w")(lambda: "x")
    for option, seconds in [  # changed after @tool checked them: the Run failed(internal)
        ("wait_deadline_s", float("inf")),
        ("wait_deadline_s", float("nan")),
        ("wait_deadline_s", -5.0),
        ("timeout_s", 10**30),
    ]:
        with pytest.raises(ToolDefinitionError, match=option):
            agent(tools=[dataclasses.replace(waits, **{option: seconds})])
    for name, seconds in (("rate_limit_wait_s", 10**400), ("inference_timeout_s", 10**400)):
        with pytest.raises(ValueError, match=name):  # was an OverflowError
            agent(**{name: seconds})


@pytest.mark.parametrize(
    "name", ["", "<lambda>", "files.read", "has space", "x" * 65, "caf\u00e9", "bad\ud800", "a\x00"]
)
def test_a_tool_named_as_no_provider_accepts_is_refused_when_built(name: str) -> None:
    """A name the model's provider refuses (OpenAI's and Anthropic's rule, which MCP
    tools are held to too) failed each Run at its first inference; one with an unpaired
    surrogate or a NUL raised UnicodeEncodeError or a bare ValueError from pydantic."""
    with pytest.raises(ToolDefinitionError, match="a tool name must be 1 to 64"):
        tool(name=name)(lambda: "x")
    assert tool(name="x" * 64)(lambda: "x").id == "x" * 64  # the rule's edge is a name


def _positional(x: int, /) -> str:
    return "x"


async def _agen() -> AsyncIterator[str]:
    yield "x"


def _gen() -> Iterator[str]:
    yield "x"


@pytest.mark.parametrize(
    ("fn", "said"),
    [(_positional, "positional-only x"), (_agen, "generator"), (_gen, "generator")],
    ids=["positional-only", "async generator", "generator"],
)
def test_a_function_that_cannot_run_as_a_tool_is_refused_when_built(fn, said) -> None:
    """A positional-only parameter failed every call (arguments go by name); a generator
    function's call returns a generator, the body never run, and its text was committed
    as the tool's successful result."""
    with pytest.raises(ToolDefinitionError, match=said):
        tool(fn)


class _Flight(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel)
    departure_airport: str
    seat_count: int


class _Named(BaseModel):
    name: str

    @field_validator("name")
    @classmethod
    def tag(cls, value: str) -> str:
        return value + "!"


@tool
def fly(flight: _Flight) -> str:
    return f"{flight.departure_airport} x{flight.seat_count}"


@tool
def greet(who: _Named) -> str:
    return who.name


async def test_a_typed_argument_is_validated_once_as_the_model_sent_it():
    """A model parameter with aliases is sent by its aliases (its dump by field name did not
    validate back), and its validators run once (a non-idempotent one ran twice)."""
    from runtime.ports import Finished
    from runtime.tool_calls import LocalToolRunner

    flights = _parsed_call(fly, {"flight": {"departureAirport": "SFO", "seatCount": 2}})
    greeting = _parsed_call(greet, {"who": {"name": "ann"}})
    flown, greeted = await LocalToolRunner([fly, greet]).run([flights, greeting])
    assert isinstance(flown, Finished) and flown.output.content == "SFO x2"
    assert isinstance(greeted, Finished) and greeted.output.content == "ann!"


class _Careless(BaseModel):
    x: dict[str, object]

    @field_validator("x")
    @classmethod
    def keyed(cls, value: dict[str, object]) -> object:
        return value["k"]  # a KeyError on input without "k", as a careless validator does


_validations: list[int] = []


class _Once(BaseModel):
    n: int

    @field_validator("n")
    @classmethod
    def once(cls, value: int) -> int:
        _validations.append(value)
        if len(_validations) > 1:  # where the tool runs (``Tool._typed``), not at the gate
            raise SystemExit(2)
        return value


@tool
def careless(p: _Careless) -> str:
    return "ok"


@tool(timeout_s=5)
def once(p: _Once) -> str:
    return "ok"


async def test_a_parameter_validator_that_raises_anything_refuses_the_model_s_arguments():
    """pydantic passes on what a validator raises unless it is a ValueError: a KeyError
    out of the model's arguments failed the Run ``internal``, no result committed. It is
    the model's error to see; and one raised where the tool runs (SystemExit, under a
    timeout: asyncio re-raises it out of the loop) is the call's error."""
    from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel, call
    from runtime.messages import ToolResultMessage
    from runtime.ports import Finished
    from runtime.tool_calls import LocalToolRunner
    from storage.memory import MemoryCommitStore

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("careless", "c1", p={"x": {}}),)), ModelResponse(text="ok")]
    )
    runner = InProcessRunner(Agent(name="a", model=model, tools=[careless]), MemoryCommitStore())
    done = await runner.start("go", thread_id="t")
    assert done.run_state.cause.kind == "natural", done.run_state
    (result,) = [m for m in done.messages if isinstance(m, ToolResultMessage)]
    assert result.is_error and "KeyError" in result.content

    _validations.clear()
    (outcome,) = await LocalToolRunner([once]).run([_parsed_call(once, {"p": {"n": 1}})])
    assert isinstance(outcome, Finished) and outcome.output.is_error
    assert "SystemExit" in outcome.output.content
