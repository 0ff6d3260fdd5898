"""Many concurrent clients get exactly what offline generation gives (temperature 0)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from mambaserve import SamplingParams

openai = pytest.importorskip("openai")

N = 64
MAX_TOKENS = 8


def _prompts() -> list[str]:
    rng = random.Random(0)
    words = ["to", "be", "or", "not", "the", "king", "love", "night", "sword", "crown", "ROMEO",
             "JULIET", "fair", "sweet", "death", "O", "!", "?", ","]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(N)]


@pytest.mark.slow
def test_concurrent_requests_match_offline(server, offline):
    """64 clients at once, four kinds (plain, streamed, token ids, streamed chat), on a server
    that runs 16 sequences at a time: every output equals offline generation."""
    prompts = _prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    t0 = time.perf_counter()
    ref = [o.outputs[0].text for o in offline.generate(prompts, greedy)]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    ref_chat = [o.outputs[0].text for o in offline.chat(chats[3::4], greedy)]
    ids = [offline.get_tokenizer().encode(p) for p in prompts]
    t1 = time.perf_counter()

    async def main():
        client = server.async_client(timeout=120)
        kw = {"model": server.model, "max_tokens": MAX_TOKENS, "temperature": 0}

        async def one(i: int) -> str:
            if i % 4 == 0:
                r = await client.completions.create(prompt=prompts[i], **kw)
                return r.choices[0].text
            if i % 4 == 1:
                text = ""
                async for ch in await client.completions.create(prompt=prompts[i], stream=True,
                                                                **kw):
                    text += ch.choices[0].text if ch.choices else ""
                return text
            if i % 4 == 2:
                r = await client.completions.create(prompt=ids[i], **kw)
                return r.choices[0].text
            text = ""
            async for ch in await client.chat.completions.create(messages=chats[i], stream=True,
                                                                 **kw):
                text += (ch.choices[0].delta.content or "") if ch.choices else ""
            return text

        try:
            return await asyncio.gather(*(one(i) for i in range(N)))
        finally:
            await client.close()

    texts = asyncio.run(main())
    t2 = time.perf_counter()
    print(f"offline {t1 - t0:.2f} s, served {t2 - t1:.2f} s")
    want = [ref_chat[i // 4] if i % 4 == 3 else ref[i] for i in range(N)]
    assert texts == want
    pools = server.wait_idle()
    assert pools["running"] == 0 and pools["waiting"] == 0
    assert pools["free_slots"] == pools["slots"] and pools["free_pages"] == pools["pages"]
