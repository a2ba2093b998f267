"""The documented limits on what enters a Run, and the checks that enforce them.

Everything from outside — a caller's input and ids, a model's output, a tool's result,
a hook's commands, a resume payload — is checked here before anything is committed.
A refusal is ``InputRefused`` naming the limit (the field of ``Limits``) or the rule
broken (``utf8``: text with an unpaired surrogate, which no store can encode;
``control_chars``: an id with a control character; ``dot_segment``: an id that is
``.`` or ``..``). Callers' input is refused with no thread row and no Run; model and
tool output that breaks a limit becomes a model-visible error or a committed
``failed(...)`` (``admit_response``, ``admit_output``). The README's Errors has this table.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import orjson

from runtime.base import canonical_json
from runtime.errors import InputRefused
from runtime.messages import AssistantMessage, ToolResultMessage, UserMessage

if TYPE_CHECKING:
    from runtime.state import Command

KIB = 1024
MIB = 1024 * KIB
MAX_JSON_DEPTH = 128
"""The deepest ``Limits.json_depth`` may be: a stored record wraps a value in a few levels
of its own, and pydantic's JSON decoder refuses nesting past about 200 levels, so a
record nested deeper than ``STORED_DEPTH`` would be written and never read again."""
STORED_DEPTH = 160
"""The deepest a stored record (a commit, as encoded) may nest: every store refuses one
deeper before writing it (``runtime.rules.check_size``)."""


@dataclass(frozen=True)
class Limits:
    """Per system (``SystemSpec.limits``) or per engine (``Engine(limits=...)``).

    The defaults keep every commit a Run can make within the stores' default payload
    limit of 1 MiB: a commit repeats its messages' text in its facts, and a batch's
    results are in the batch, in the messages and in the facts of the commit that
    publishes them, so a results commit or an end holds up to three copies of each.
    Text is measured as stored (``stored_size``: UTF-8 with JSON's escapes)."""

    input_bytes: int = 128 * KIB
    """A Run's input text, and the text of a ``user_input`` resume (bytes as stored); also
    what the hooks (or a session's handler) hand one commit together: the messages they
    inject and their state commands. The hook that goes over fails the Run ``failed(hook,
    InputRefused)``."""
    model_text_bytes: int = 64 * KIB
    """The text of one model response."""
    response_bytes: int = 128 * KIB
    """One model response in all: its text and every tool call's arguments. A stream whose
    deltas pass it (in characters, each call's id and tool name counted too) fails its
    attempt as it streams."""
    reasoning_bytes: int = 1 * MIB
    """A model's reasoning streamed in one attempt (shown live, never committed: not part
    of ``response_bytes``); a stream past it fails its attempt."""
    tool_calls: int = 64
    """Tool calls in one model response; a stream fails its attempt at the first fragment
    of one call more."""
    tool_arguments_bytes: int = 32 * KIB
    """One tool call's raw JSON arguments."""
    tool_result_bytes: int = 32 * KIB
    """One tool result's content (a tool's output, or a caller's external result)."""
    batch_result_bytes: int = 96 * KIB
    """The results of one Step's tool calls together, with the state commands and
    messages they hand their Run; a call's outcome beyond it is an error."""
    resume_payload_bytes: int = 64 * KIB
    """A ResumeCommand's payload, encoded as JSON (but a ``user_input``: its text is held
    to ``input_bytes``)."""
    state_value_bytes: int = 32 * KIB
    """One state command's value, encoded as JSON."""
    state_bytes: int = 1 * MIB
    """A thread's state, both scopes, encoded as JSON (``state_size``): commutative keys
    grow with every Step that adds to them, and every commit carries the whole state in
    the thread's frontier. A commit that would take it past this, or further past it,
    ends the Run ``failed(history_limit, state_bytes)`` (a commit that shrinks it
    lands)."""
    json_depth: int = 64
    """Nesting of any JSON: tool arguments, state values, resume payloads (at most
    ``MAX_JSON_DEPTH``: the stores' records must decode again)."""
    id_chars: int = 256
    """Thread, run, call, message and correlation ids (characters; at least 64,
    ``MIN_ID_CHARS``: the ids Ratchet makes take up to 39). An id that names what is
    stored (a thread read, listed from, cancelled or exported, a ticket's ids in a resume)
    is held to what a store holds instead, ``STORED_ID_CHARS`` (2,560): lowered, this
    limit refuses new ids only."""
    history_bytes: int = 64 * MIB
    """A thread's message history (its texts, tool arguments and results, as stored):
    a commit past it ends the Run ``failed(history_limit, history_bytes)`` (the end
    itself lands, with the results of the Step it ends: at most ``batch_result_bytes``
    more). A wait for input keeps room for what its answer writes ahead of its text (the
    Step's results, injected messages)."""
    history_commits: int = 50_000
    """Commits on one thread: past it the Run ends ``failed(history_limit,
    history_commits)``. A Run's end is always committed, whatever the limits, and a wait
    keeps one commit for its resume."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"limit {f.name} must be a positive integer, not {value!r}")
        if self.id_chars < MIN_ID_CHARS:
            raise ValueError(
                f"limit id_chars is at least {MIN_ID_CHARS} (the ids Ratchet makes itself take "
                f"up to 39 characters), not {self.id_chars}"
            )
        if self.json_depth > MAX_JSON_DEPTH:
            raise ValueError(
                f"limit json_depth is at most {MAX_JSON_DEPTH} (a record nests a value a few "
                f"levels deeper, and the decoder stops near 200), not {self.json_depth}"
            )

    def commit_bytes(self) -> int:
        """The largest commit a Run kept within these limits can make: a Step's results
        twice (in the batch and the messages of the commit that publishes them: a commit
        stores no fact derived from its messages, schema 3), a response twice (its
        message and its calls' arguments in the batch), what the hooks hand it (the
        messages they inject and their state commands: ``input_bytes``), and room for
        the records' own fields. A store whose payload limit is below this is refused
        (``Engine``)."""
        # phases and keys of one call, and its ids three times over (4 bytes a character)
        per_call = 1 * KIB + 12 * self.id_chars
        largest = max(self.response_bytes, self.input_bytes)
        # a Step's inference commit holds its response twice beside what its hooks
        # handed (StepStart's injected messages, say): left out, a store these limits
        # were said to fit refused it (payload_too_large)
        hooks = self.input_bytes
        return 2 * self.batch_result_bytes + 2 * largest + hooks + self.tool_calls * per_call


MIN_ID_CHARS = 64
"""The least ``id_chars`` may be: a thread id the in-process runner makes takes 39."""
STORED_ID_CHARS = 2560
"""The longest id a store holds (its index on thread and operation ids, ``KEY_BYTES``).
An id naming what is stored (a thread read, listed, cancelled, exported or recovered, a
ticket's ids) is held to this (``STORED_IDS``), not ``id_chars``, which bounds new ids."""

DEFAULT_LIMITS = Limits()
STORED_IDS = Limits(id_chars=STORED_ID_CHARS)
"""The id rule for an id naming what is stored (``STORED_ID_CHARS``)."""

CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""C0, DEL and C1: U+009B is a terminal's CSI, as ESC [ is."""
_ESCAPED = re.compile(r'[\x00-\x1f"\\]')
_SPECIAL = re.compile(r'[\[\]{}"\\]')


def utf8_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored as UTF-8 (an unpaired surrogate), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid Unicode text (an unpaired surrogate at character {exc.start})"
    return None


_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")


def joined(fragments: Iterable[str]) -> str:
    """Streamed fragments as one text. A provider may cut a character outside the BMP
    between two chunks, each JSON-escaped alone (``"\\ud83d"`` then ``"\\ude00"``):
    the halves, adjacent once joined, are made the one character they encode. A half
    with no partner is left as it is, for ``utf8_problem`` to refuse."""
    text = "".join(fragments)
    if text.isascii() or utf8_problem(text) is None:
        return text
    return _PAIR.sub(lambda m: m[0].encode("utf-16-le", "surrogatepass").decode("utf-16-le"), text)


def too_many_digits(exc: BaseException) -> bool:
    """Whether ``exc`` is Python's refusal of an integer longer than it converts
    (``sys.get_int_max_str_digits``: a plain ValueError whose text advises a setting)."""
    return isinstance(exc, ValueError) and "integer string conversion" in str(exc)


def live_piece(held: str, text: str) -> tuple[str, str]:
    """A streamed chunk made valid Unicode for live followers: ``(to publish, to hold)``.
    A high surrogate that ends the chunk (the first half of a character the provider cut)
    is held and put before the next chunk's text, so the halves travel as the one
    character; a half with no partner is published as U+FFFD. Encoders of the live path
    (a Redis bus, an SSE stream) cannot carry a lone half; the committed text is joined
    and checked apart from this (``joined``)."""
    text = held + text
    if text.isascii():
        return text, ""
    held = text[-1] if "\ud800" <= text[-1] <= "\udbff" else ""
    if held:
        text = text[:-1]
    if utf8_problem(text) is not None:
        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text, held


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def stored_size(text: str) -> int:
    """The bytes ``text`` takes as a string in a stored commit: UTF-8, with JSON's
    escapes (a quote or backslash takes 2 bytes, a control character 6), which is what
    every text limit bounds: a limit on raw length would let 64 KiB of NULs take 384."""
    size = _utf8_len(text)
    if not _ESCAPED.search(text):
        return size
    try:
        return len(orjson.dumps(text)) - 2
    except TypeError:  # an unpaired surrogate (refused by every check before this)
        return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass")) - 2


def check_text(what: str, text: object, max_bytes: int, limit: str) -> str:
    """``text`` if it is storable text of at most ``max_bytes``; else InputRefused."""
    if not isinstance(text, str):
        raise InputRefused(what, "type", f"expected text, got {type(text).__name__}")
    problem = utf8_problem(text)
    if problem is not None:
        raise InputRefused(what, "utf8", problem)
    size = stored_size(text)
    if size > max_bytes:
        raise InputRefused(what, limit, f"{size} bytes; the limit is {max_bytes} bytes")
    return text


def handed_bytes(command: Command) -> int:
    """The bytes a state command adds to a commit (its key and its value as JSON), as
    stored: UTF-8, not characters (an emoji is four bytes, one character)."""
    value = canonical_json(command.value)
    return stored_size(command.key) + (len(value) if value.isascii() else len(value.encode()))


def check_reason(reason: object, limits: Limits = DEFAULT_LIMITS) -> str:
    """A caller's stop reason (kept in the Run's end): storable text of at most
    ``input_bytes``, as a Run's input is, that says something; else InputRefused."""
    text = check_text("stop reason", reason, limits.input_bytes, "input_bytes")
    if not text.strip():
        raise InputRefused("stop reason", "empty", "a stop says why: give a reason")
    return text


def check_id(what: str, value: object, limits: Limits = DEFAULT_LIMITS) -> str:
    """A usable id: non-empty text, at most ``id_chars``, no control characters."""
    if not isinstance(value, str) or not value:
        raise InputRefused(what, "type", f"expected a non-empty id, got {value!r:.80}")
    if len(value) > limits.id_chars:
        raise InputRefused(
            what, "id_chars", f"{len(value)} characters; the limit is {limits.id_chars}"
        )
    problem = utf8_problem(value)
    if problem is not None:
        raise InputRefused(what, "utf8", problem)
    if CONTROL_CHARS.search(value):
        raise InputRefused(what, "control_chars", "ids may not hold control characters")
    if value in DOT_SEGMENTS:
        # a URL's path step, not a name: every HTTP client resolves it before sending, so
        # a thread of this id could never be addressed (``/threads/./commits`` would be
        # sent as ``/threads/commits``, another thread's)
        raise InputRefused(what, "dot_segment", f"{value!r} is a step in a URL path, not an id")
    return value


DOT_SEGMENTS = frozenset({".", ".."})


def json_depth(text: str) -> int:
    """How deeply the JSON text ``text`` nests arrays and objects (strings ignored).

    Counted on the text, before any parser recurses into it (Python's json module
    raises RecursionError around 1,000 levels; pydantic refuses earlier).
    """
    if "[" not in text and "{" not in text:
        return 0  # nothing opens: no scan (a bracket inside a string opens nothing either,
        # so a count of them is only a bound: ``check_json_text`` uses it as one)
    # one pass, jumping between the characters that matter (a text of unterminated
    # strings cost a regex of whole strings a scan from each quote: quadratic)
    depth = deepest = 0
    in_string, escaped_at = False, -1
    for match in _SPECIAL.finditer(text):
        at = match.start()
        if at == escaped_at:
            continue  # the character after a backslash
        ch = text[at]
        if in_string:
            if ch == "\\":
                escaped_at = at + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def check_json_text(what: str, text: str, limits: Limits = DEFAULT_LIMITS) -> None:
    if text.count("[") + text.count("{") <= limits.json_depth:
        return  # it cannot nest deeper than it opens
    depth = json_depth(text)
    if depth > limits.json_depth:
        raise InputRefused(
            what, "json_depth", f"JSON nested {depth} deep; the limit is {limits.json_depth}"
        )


def check_json_value(
    what: str, value: Any, max_bytes: int, limit: str, limits: Limits = DEFAULT_LIMITS
) -> None:
    """A JSON value (dicts, lists, str, numbers, bool, None) that can be stored: nested
    at most ``json_depth``, its text storable, finite numbers, at most ``max_bytes``."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            problem = utf8_problem(item)
            if problem is not None:
                raise InputRefused(what, "utf8", problem)
        elif isinstance(item, float) and not math.isfinite(item):
            raise InputRefused(what, "type", "NaN and infinities are not JSON")
        elif isinstance(item, dict | list | tuple):
            if depth >= limits.json_depth:
                raise InputRefused(
                    what, "json_depth", f"JSON nested deeper than {limits.json_depth}"
                )
            if isinstance(item, dict):
                for key, child in item.items():
                    stack.append((key, depth + 1))
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)
        elif not (item is None or isinstance(item, bool | int | float)):
            raise InputRefused(what, "type", f"{type(item).__name__} is not JSON")
    try:
        size = _utf8_len(canonical_json(value))
    except (ValueError, TypeError) as exc:  # an int of over 4,300 digits, say
        raise InputRefused(what, "type", f"cannot be written as JSON: {exc}") from None
    if size > max_bytes:
        raise InputRefused(what, limit, f"{size} bytes as JSON; the limit is {max_bytes} bytes")


def printable(text: str, max_chars: int = 2000) -> str:
    """``text`` made storable (unpaired surrogates escaped) and cut to ``max_chars``: for
    error messages built from exceptions, which may quote anything."""
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def short_code(code: str) -> str:
    """``code`` as a failure records it: storable and at most 80 characters. A code is
    often a type's name, and a generated class may be named anything, megabytes long:
    an end that carried it whole could not be committed, and the Run would stay running."""
    return printable(code, 80)


_UNSEEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
"""What a terminal obeys or cannot encode rather than shows: the C0 and C1 control
characters but tab and newline (ESC opens a sequence that moves the cursor, erases a
line or retitles the window; CR returns over a line) and unpaired surrogates."""


def escaped_char(match: re.Match[str]) -> str:
    """The matched character as its Python escape: ``\\x1b``, ``\\udcff``."""
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` for a terminal: each character of ``_UNSEEN`` as its escape, so text
    someone stored (a model's, a tool's, a caller's) is shown as it is and never acts on
    the terminal showing it. Escapes are themselves visible: applying it twice is once."""
    return _UNSEEN.sub(escaped_char, text)


def said(exc: BaseException) -> str:
    """What ``exc`` says, made storable; an exception whose ``__str__`` raises (anything,
    SystemExit included) says so instead of raising out of the code describing it."""
    try:
        return printable(str(exc))
    except BaseException:
        return "<an exception that cannot be printed>"


def raised(exc: BaseException) -> str:
    """``Type: what it says``, for an error message that quotes an exception."""
    return printable(f"{type(exc).__name__}: {said(exc)}")


def limits_table(limits: Limits = DEFAULT_LIMITS) -> list[tuple[str, int, str]]:
    """(name, value, what it bounds) of every limit: the README's table is checked against it."""
    docs = _field_docs()
    return [(f.name, getattr(limits, f.name), docs.get(f.name, "")) for f in fields(limits)]


def _field_docs() -> dict[str, str]:
    import inspect

    source = inspect.getsource(Limits)
    found = re.findall(r"\n    (\w+): int = [^\n]+\n    \"\"\"(.+?)\"\"\"", source, re.DOTALL)
    return {name: " ".join(doc.split()) for name, doc in found}


__all__: Sequence[str] = (
    "DEFAULT_LIMITS",
    "STORED_IDS",
    "Limits",
    "check_id",
    "check_json_text",
    "check_json_value",
    "check_text",
    "json_depth",
    "limits_table",
    "printable",
    "raised",
    "said",
    "stored_size",
    "utf8_problem",
)


def check_room(store: object, limits: Limits) -> None:
    """Every commit a Run can make under ``limits`` must fit the store: else a Step's end
    could be refused for its size, and the Run could not end as the design says."""
    payload_limit = getattr(store, "payload_limit", None)
    if isinstance(payload_limit, int) and payload_limit < limits.commit_bytes():
        raise ValueError(
            f"the store's payload limit ({payload_limit} bytes) is below the largest commit "
            f"these limits allow ({limits.commit_bytes()} bytes): lower the limits "
            "(runtime.limits.Limits) or raise the store's payload_limit"
        )


_LONG_ID_LIMITS: dict[int, Limits] = {}


def long_id_limits(id_chars: int) -> Limits:
    """The limits an id made of other ids is held to (four times ``id_chars``: a cluster's
    input id names its Run, placement and agent; a correlation embeds an operation id),
    made once per ``id_chars``: a Limits checks every field as it is made, which cost
    more than the check it serves."""
    made = _LONG_ID_LIMITS.get(id_chars)
    if made is None:
        made = _LONG_ID_LIMITS[id_chars] = Limits(id_chars=4 * id_chars)
    return made


def history_size(messages: Sequence[Any]) -> int:
    """What ``history_bytes`` bounds: the stored size of the messages' texts, tool
    arguments and results (the ids and keys around them are not counted)."""
    size = 0
    for m in messages:
        kind = type(m)
        # our records by their type: a getattr that misses on a record raises (and
        # catches) an AttributeError inside pydantic, which cost more than the sizes
        if kind is ToolResultMessage:
            size += stored_size(m.content)
        elif kind is AssistantMessage:
            size += stored_size(m.text)
            for use in m.tool_calls:
                size += stored_size(use.arguments)
        elif kind is UserMessage:
            size += stored_size(m.text)
        else:
            text = getattr(m, "text", None)
            size += stored_size(text if text is not None else getattr(m, "content", ""))
            for use in getattr(m, "tool_calls", ()):
                size += stored_size(use.arguments)
    return size


def state_size(state: Any) -> int:
    """What ``state_bytes`` bounds: the state as JSON, in UTF-8 bytes."""
    try:
        return len(orjson.dumps(state))
    except TypeError:  # an integer past 64 bits, which orjson does not write
        return len(canonical_json(state).encode("utf-8", "surrogatepass"))


def history_headroom(messages: Sequence[Any], commits: int, limits: Limits) -> dict[str, int]:
    """How close a thread is to its history limits (for ``ratchet show`` and the API)."""
    return {
        "bytes": history_size(messages),
        "bytes_limit": limits.history_bytes,
        "commits": commits,
        "commits_limit": limits.history_commits,
    }
