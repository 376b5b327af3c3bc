"""The collector between the engine client's reader and a request's handler: outputs the
handler has not taken yet are merged (DELTA) or replaced (the other kinds), an error wins, and
a handler that keeps up sees every output on its own."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagoda_daemon.outputs import CompletionOutput, RequestOutput, RequestOutputKind, RequestTiming
from pagoda_daemon.server.output_collector import OutputCollector


def _delta(i: int, token: int, finish: str | None = None, logprob: float | None = None,
           prompt_logprobs=None) -> RequestOutput:
    logprobs = None if logprob is None else [{token: logprob}]
    completion = CompletionOutput(0, f"<{token}>", [token], finish, None, logprobs)
    return RequestOutput("r", None, [1, 2], [completion], finish is not None, num_cached_tokens=i,
                         metrics=RequestTiming(float(i)), prompt_logprobs=prompt_logprobs)


def test_a_slow_reader_gets_every_token_of_the_deltas_it_missed_in_one_output():
    rng = random.Random()
    tokens = [rng.randrange(1, 50_000) for _ in range(rng.randrange(3, 40))]
    logprobs = [-rng.random() * 10 for _ in tokens]
    collector = OutputCollector(RequestOutputKind.DELTA)
    first = _delta(0, tokens[0], logprob=logprobs[0], prompt_logprobs=[None, {2: -0.5}])
    collector.put(first)
    for i, (t, lp) in enumerate(zip(tokens[1:], logprobs[1:], strict=True), 1):
        collector.put(_delta(i, t, "length" if i == len(tokens) - 1 else None, lp))

    out = asyncio.run(collector.get())
    c = out.outputs[0]
    assert c.token_ids == tokens
    assert c.text == "".join(f"<{t}>" for t in tokens)
    assert c.logprobs == [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)]
    assert (c.finish_reason, out.finished) == ("length", True)
    assert out.prompt_logprobs == [None, {2: -0.5}]  # the first output's, not lost to a later one
    assert out.num_cached_tokens == len(tokens) - 1 and out.metrics.arrival_time == len(tokens) - 1


def test_a_reader_that_keeps_up_sees_each_output_on_its_own():
    async def run() -> list[list[int]]:
        collector = OutputCollector(RequestOutputKind.DELTA)
        seen = []

        async def read():
            while True:
                out = await collector.get()
                seen.append(out.outputs[0].token_ids)
                if out.finished:
                    return

        reader = asyncio.create_task(read())
        for i in range(5):
            collector.put(_delta(i, 100 + i, "stop" if i == 4 else None))
            await asyncio.sleep(0)  # the reader runs between two outputs
            await asyncio.sleep(0)
        await reader
        return seen

    assert asyncio.run(run()) == [[100], [101], [102], [103], [104]]


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
def test_outputs_that_carry_everything_so_far_replace_the_waiting_one(kind):
    collector = OutputCollector(kind)
    older, newer = _delta(0, 7), _delta(1, 8, "stop")
    collector.put(older)
    collector.put(newer)
    assert asyncio.run(collector.get()) is newer


def test_an_error_wins_over_waiting_outputs_and_later_ones():
    collector = OutputCollector(RequestOutputKind.DELTA)
    collector.put(_delta(0, 7))
    collector.put(RuntimeError("engine died"))
    collector.put(_delta(1, 8))
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(collector.get())


def test_get_waits_for_the_next_output():
    async def run() -> RequestOutput:
        collector = OutputCollector(RequestOutputKind.DELTA)
        getter = asyncio.create_task(collector.get())
        await asyncio.sleep(0.01)
        assert not getter.done()
        collector.put(_delta(0, 9))
        return await asyncio.wait_for(getter, 1)

    assert asyncio.run(run()).outputs[0].token_ids == [9]
