"""OpenAI's `n`: several completions (choices) of one prompt, each its own GenerationRequest.

They share the prompt's prefill through the block cache: the scheduler has a request whose prompt
another one in the batch is prefilling wait for that one's prompt blocks (engine/batch/prefix_waits.py), so
the first choice prefills the prompt and the others start from its blocks, prefilling only the
partial block at its end. The reply has one `choices` entry per completion (index 0..n-1); usage
counts the prompt once, as OpenAI does, and the completion tokens of every choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from ...engine.request import GenerationRequest, Usage

T = TypeVar("T")
_END = object()


def combined_usage(usages: Sequence[Usage]) -> Usage:
    """The usage of n choices: the prompt once, with the cached tokens the first choice found (what
    the cache held before this request), and every choice's completion tokens."""
    first = usages[0]
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages), first.cached_tokens)


def merge_bodies(bodies: Sequence[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    """One reply from each choice's whole reply (the first's id): their choices, indexed 0..n-1."""
    merged = dict(bodies[0])
    merged["choices"] = [body["choices"][0] | {"index": i} for i, body in enumerate(bodies)]
    merged["usage"] = usage
    return merged


async def gather(waits: Sequence[Awaitable[T]], gen_reqs: Sequence[GenerationRequest]) -> list[T]:
    """Each choice's result, awaited together. When one raises, the others are cancelled (their
    tasks and their generations) and its exception is raised."""
    if len(waits) == 1:
        return [await waits[0]]
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a no-op for the finished ones
        for gen_req in gen_reqs:
            gen_req.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of every stream as they come. An exception in one ends the merge with it; a merge
    closed early (its consumer stopped) cancels the streams still running."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((item, None))
        except Exception as exc:
            queue.put_nowait((_END, exc))
            return
        queue.put_nowait((_END, None))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
