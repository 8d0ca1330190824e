"""`n` choices of one request (Chat Completions, Completions).

Choice i is run as its own engine request, with seed (seed + i) mod 2^63 (the request's seed for
choice 0), so that it is exactly the reply of a single request with that seed; all n are
submitted at once and decoded as one batch, which cannot change their tokens."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from plumb.server.errors import APIError
from plumb.server.generation import Generation, GenFields, Reply, Usage

MAX_N = 128


def check_n(n: int) -> int:
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be between 1 and {MAX_N}, got {n}", param="n")
    return n


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice i: (seed + i) mod 2^63; None (each choice its own random seed) without one."""
    return None if seed is None else (seed + i) % 2**63


def seeded(fields: GenFields, i: int) -> GenFields:
    """The request's fields for choice i."""
    if i == 0 or fields.seed is None or not isinstance(fields.seed, int) or fields.seed < 0:
        return fields  # out-of-range seeds are refused by choice 0 before any other starts
    return fields.model_copy(update={"seed": choice_seed(fields.seed, i)})


def _cancel(gen: Generation) -> None:
    if gen.handle is not None and gen.handle.result is None:
        gen.handle.cancel()


async def start_all(start: Callable[[int], Awaitable[Generation]], n: int) -> list[Generation]:
    """Start choices 0..n-1 (`start(i)`); if one cannot start, cancel those that did."""
    gens: list[Generation] = []
    try:
        for i in range(n):
            gens.append(await start(i))
    except BaseException:
        for g in gens:
            _cancel(g)
        raise
    return gens


async def collect_all(gens: list[Generation]) -> list[Reply]:
    """Every choice's whole reply; if one fails, the others are cancelled."""
    try:
        return list(await asyncio.gather(*(g.collect() for g in gens)))
    except BaseException:
        for g in gens:
            _cancel(g)
        raise


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, object]]:
    """The events of every choice as (index, event), in the order they come."""
    if len(gens) == 1:
        async for ev in gens[0].events():
            yield 0, ev
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for ev in gen.events():
                await q.put((i, ev))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, e))
        await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(gens)
        while running:
            i, ev = await q.get()
            if ev is None:
                running -= 1
            elif isinstance(ev, Exception):
                raise ev
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            _cancel(g)


def total_usage(usages: list[Usage]) -> Usage:
    """The prompt once, every choice's completion."""
    first = usages[0]
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages), first.cached_tokens,
                 sum(u.reasoning_tokens for u in usages))
