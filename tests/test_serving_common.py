"""The shared pieces of the chat and completion handlers: how a request's engine
streams end, streamed and not."""

import asyncio
import json

import pytest

from loraserve.engine.output_processor import CompletionOutput, RequestOutput
from loraserve.entrypoints.core_client import EngineDeadError
from loraserve.entrypoints.errors import APIError, bad_request
from loraserve.entrypoints.serving_common import SSE_DONE, final_outputs, sse_events


def collect(events):
    async def run():
        return [event async for event in events]

    return asyncio.run(run())


def events_then(failure):
    async def events():
        yield "data: first\n\n"
        if failure is not None:
            raise failure

    return events()


def error_body(event: str) -> dict:
    return json.loads(event.removeprefix("data: "))["error"]


def test_sse_events_end_with_done():
    assert collect(sse_events(events_then(None))) == ["data: first\n\n", SSE_DONE]


@pytest.mark.parametrize("failure,code", [(bad_request("adapter failed"), 400),
                                          (EngineDeadError(), 503)])
def test_sse_events_turn_an_error_into_an_error_event_then_done(failure, code):
    first, error, done = collect(sse_events(events_then(failure)))
    assert first == "data: first\n\n" and done == SSE_DONE
    assert error_body(error)["code"] == code


def request_stream(*finish_reasons, error=None):
    async def stream():
        outputs = [CompletionOutput(index=i, finish_reason=r, error=error)
                   for i, r in reversed(list(enumerate(finish_reasons)))]
        yield RequestOutput("r", None, [1], outputs, finished=True)

    return stream()


def test_final_outputs_in_index_order_per_stream():
    results = asyncio.run(final_outputs([request_stream("stop", "length"),
                                         request_stream("stop")]))
    assert [[o.index for o in outs] for outs in results] == [[0, 1], [0]]
    assert results[0][1].finish_reason == "length"


def test_final_outputs_raise_the_failed_sequence_as_400():
    with pytest.raises(APIError) as info:
        asyncio.run(final_outputs([request_stream("stop", "error", error="no adapter")]))
    assert info.value.status == 400 and "no adapter" in info.value.message


def test_final_outputs_raise_503_when_the_engine_died():
    async def dead():
        raise EngineDeadError()
        yield  # an async generator

    with pytest.raises(APIError) as info:
        asyncio.run(final_outputs([dead()]))
    assert info.value.status == 503
