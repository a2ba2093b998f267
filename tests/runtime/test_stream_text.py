"""``cluster.stream.StreamText``: a Step's text is kept once its assistant message is
committed, whichever came first to the client — its deltas (live, over the bus) or its
fact (read from the store) — and the text of a Step lost with its execution starts over."""

from __future__ import annotations

from cluster.stream import StreamText
from runtime.events import Delta, Fact
from runtime.ids import RunId
from runtime.lifecycle import ThreadStatus
from runtime.stream import Frame

RUN = RunId("r")


def status(state: str) -> Frame:
    return Frame(type="thread_status", status=ThreadStatus(state=state))  # type: ignore[arg-type]


def delta(step: int, text: str, attempt: int = 1) -> Frame:
    event = Delta(type="text_delta", run_id=RUN, step=step, attempt=attempt, text=text)
    return Frame(type="delta", event=event)


def answered(text: str, seq: int) -> Frame:
    event = Fact(type="assistant_message", run_id=RUN, data={"text": text}, seq=seq)
    return Frame(type="fact", offset=f"{seq}:0", event=event)


def test_deltas_after_their_committed_fact_survive_a_lost_execution() -> None:
    text = StreamText()
    frames = [
        status("running"),
        answered("let me check", 2),  # read from the store before the live deltas came
        delta(0, "let me "),
        delta(0, "check"),
        delta(1, "the answer might "),  # step 1, not committed: lost with the host
        status("failed"),
        status("running"),
        delta(1, "the answer is 42"),
    ]
    for frame in frames:
        text.add(frame)
    assert text.text(RUN, 0) == "let me check"
    assert text.text(RUN, 1) == "the answer is 42"


def test_an_uncommitted_step_starts_over_when_the_run_runs_again() -> None:
    text = StreamText()
    for frame in [status("running"), delta(0, "half "), status("failed"), status("running")]:
        text.add(frame)
    assert text.text(RUN, 0) == ""
    for frame in [delta(0, "whole"), answered("whole", 2), status("idle")]:
        text.add(frame)
    assert text.text(RUN, 0) == "whole"
