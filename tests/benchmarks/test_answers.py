"""The driver keeps a compact ``Answer`` per Run instead of its frontier; the checks on
it must still tell a natural end with the right text from everything else."""

from __future__ import annotations

import gc

from benchmarks.verify import Answer, Verdict, _check_end
from benchmarks.w1_agent import W1
from runtime.commit import Frontier
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import EndedState, MaxSteps, Natural, RunningState
from runtime.messages import AssistantMessage, UserMessage

PARAMS = W1()
RUN = RunId("run-1")


def _frontier(state: object, text: str) -> Frontier:
    messages = (
        UserMessage(id="run-1:input", text="hi"),
        AssistantMessage(text=text),
        UserMessage(id="later", text="not the model's"),
    )
    return Frontier(thread_id=ThreadId("t"), version=10, run_id=RUN, run_state=state,
                    messages=messages)  # fmt: skip


def _checked(frontier: Frontier) -> Verdict:
    verdict = Verdict()
    _check_end(verdict, PARAMS, "t", RUN, Answer.of(frontier))
    return verdict


def test_a_natural_end_with_the_final_text_passes() -> None:
    frontier = _frontier(EndedState(run_id=RUN, cause=Natural()), PARAMS.final_text(RUN))
    answer = Answer.of(frontier)
    assert answer == (RUN, 10, "EndedState", "natural", PARAMS.final_text(RUN))
    verdict = _checked(frontier)
    assert (verdict.natural_runs, verdict.wrong_text, verdict.problems) == (1, 0, [])


def test_wrong_text_another_end_and_no_end_are_problems() -> None:
    wrong = _checked(_frontier(EndedState(run_id=RUN, cause=Natural()), "something else"))
    assert (wrong.natural_runs, wrong.wrong_text) == (1, 1)
    capped = _checked(_frontier(EndedState(run_id=RUN, cause=MaxSteps()), PARAMS.final_text(RUN)))
    assert capped.natural_runs == 0 and capped.problems == ["t: ended max_steps"]
    running = _checked(_frontier(RunningState(run_id=RUN), PARAMS.final_text(RUN)))
    assert running.natural_runs == 0 and running.problems == ["t: not ended (RunningState)"]


def _tracked(root: object) -> int:
    """Objects the collector tracks reachable from ``root`` (classes aside)."""
    seen: dict[int, object] = {}
    todo = [root]
    while todo:
        item = todo.pop()
        if id(item) in seen or not gc.is_tracked(item) or isinstance(item, type):
            continue
        seen[id(item)] = item
        todo.extend(gc.get_referents(item))
    return len(seen)


def test_an_answer_is_one_object_for_the_collector() -> None:
    frontier = _frontier(EndedState(run_id=RUN, cause=Natural()), "x")
    assert _tracked(Answer.of(frontier)) == 1
    assert _tracked(frontier) > 10  # what the driver held per Run before
