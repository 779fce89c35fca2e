"""The async front (thread mode): a loop that dies ends its requests at once and is
rebuilt; one that keeps dying gives up; a stream never consumed costs nothing."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import tiny_loaded
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine import front
from tokenmill.engine.api import EngineClient, EngineDeadError, InvalidParameter, SamplingParams
from tokenmill.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded()


def engine_for(tiny) -> AsyncEngine:
    return AsyncEngine(tiny, EngineConfig(cache=CacheConfig(num_blocks=64),
                                          scheduler=SchedulerConfig(decode_steps=1)))


SP = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)


def gen(engine, request_id: str, ids: list[int], params: SamplingParams):
    """A request as a client runs it: resolved by the served model, then generated."""
    return engine.generate(request_id, ids, engine.served().resolve([ids], params))


async def wait_for(cond, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


def test_it_is_an_engine_client(tiny):
    async def run() -> None:
        engine = engine_for(tiny)
        await engine.start()
        try:
            assert isinstance(engine, EngineClient)
        finally:
            await engine.stop()
    asyncio.run(run())


def test_a_dead_loop_ends_requests_in_flight_and_is_restarted(tiny, monkeypatch):
    async def run() -> None:
        engine = engine_for(tiny)
        await engine.start()
        try:
            first = engine.engine
            got = 0
            with pytest.raises(EngineDeadError):
                async for _ in gen(engine, "a", [1, 2, 3], SP):
                    got += 1
                    if got == 3:
                        def boom():
                            raise RuntimeError("injected step failure")
                        monkeypatch.setattr(first, "step", boom)
            assert got >= 3
            await wait_for(lambda: engine.running)
            assert engine.restarts == 1 and engine.stats().engine_restarts == 1
            assert engine.engine is not first and engine.error is None
            outs = [o async for o in gen(engine, "b", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))]
            assert outs[-1].finished and outs[-1].num_output_tokens == 4
        finally:
            await engine.stop()
    asyncio.run(run())


def test_a_loop_that_keeps_dying_gives_up(tiny, monkeypatch):
    from tokenmill.engine.llm_engine import LLMEngine

    def boom(self):
        raise RuntimeError("always failing")

    async def run() -> None:
        engine = engine_for(tiny)
        gave_up = asyncio.Event()
        engine.on_give_up = gave_up.set
        await engine.start()
        monkeypatch.setattr(LLMEngine, "step", boom)
        monkeypatch.setattr(front, "MAX_RESTARTS", 2)
        try:
            for i in range(3):
                await wait_for(lambda: engine.running or engine.gave_up)
                if engine.gave_up:
                    break
                with pytest.raises(EngineDeadError):
                    async for _ in gen(engine, f"r{i}", [1, 2], SP):
                        pass
            await asyncio.wait_for(gave_up.wait(), 10)
            assert engine.gave_up and engine.restarts == 2
            with pytest.raises(EngineDeadError):
                gen(engine, "late", [1, 2], SP)
        finally:
            await engine.stop()
    asyncio.run(run())


def test_generate_checks_at_once_and_queues_only_when_consumed(tiny):
    async def run() -> None:
        engine = engine_for(tiny)
        await engine.start()
        try:
            with pytest.raises(InvalidParameter) as ei:
                gen(engine, "bad", [1, 2], SamplingParams(n=1000))
            assert ei.value.param == "n"
            with pytest.raises(InvalidParameter):
                gen(engine, "bad2", [1, 10 ** 12], SP)
            stream = gen(engine, "never", [1, 2, 3], SP)  # never iterated
            await asyncio.sleep(0.2)
            assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0
            await stream.aclose()
            # one consumer that leaves early aborts its request and frees its blocks
            async for out in gen(engine, "early", [1, 2, 3], SP):
                break
            await wait_for(lambda: engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0)
        finally:
            await engine.stop()
    asyncio.run(run())
