"""`bench serve --dataset multiturn`: chat sessions that resend their whole history.

Every conversation starts with the same system prompt (`--shared-prefix-len` tokens, e.g.
2048), then runs `--num-turns` turns: turn t sends system + user_1 + reply_1 + ... + user_t
(each user message `--input-len` tokens), waits for the answer (`--output-len` tokens), then
"thinks" for an exponentially distributed time of mean `--think-time` seconds before the next
turn. `--num-prompts` requests make num_prompts // num_turns conversations; they start with
Poisson arrivals at `--request-rate` conversations per second, at most `--max-concurrency` at
once (a session holds its place for all its turns).

Prompts are token ids (the preset checkpoints have no tokenizer), and the completions API
returns text, not ids, so the reply in the history is a stand-in of `--output-len` random ids
drawn by the client, not the server's answer. A follow-up turn therefore shares with the prefix
cache everything up to the end of the previous turn's prompt (the system prompt and every
earlier user message and stand-in), but not the previous answer's blocks; a real chat's hit
rate is higher by about one answer per turn.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass
class Conversation:
    index: int
    users: list[list[int]]  # one user message per turn
    replies: list[list[int]]  # the stand-in answer appended to the history after each turn

    def prompt(self, system: list[int], turn: int) -> list[int]:
        """Token ids of turn `turn` (0-based): the system prompt and the whole history."""
        ids = list(system)
        for t in range(turn):
            ids += self.users[t] + self.replies[t]
        return ids + self.users[turn]


def num_conversations(num_prompts: int, num_turns: int) -> int:
    return max(1, num_prompts // num_turns)


def make_conversations(num_prompts: int, num_turns: int, system_len: int, user_len: int,
                       reply_len: int, vocab_size: int,
                       seed: int) -> tuple[list[int], list[Conversation]]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(system_len)]

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    convs = [Conversation(i, [ids(user_len) for _ in range(num_turns)],
                          [ids(reply_len) for _ in range(num_turns)])
             for i in range(num_conversations(num_prompts, num_turns))]
    return system, convs


async def run_conversation(conv: Conversation, system: list[int], think_time_s: float,
                           seed: int, send: Callable[[list[int]], Awaitable]) -> list:
    """Turn after turn: send the history, wait for the answer, think. A failed turn ends the
    conversation (its later turns are not sent)."""
    rng = random.Random(seed * 1_000_003 + conv.index)
    results = []
    for turn in range(len(conv.users)):
        res = await send(conv.prompt(system, turn))
        res.conversation, res.turn = conv.index, turn
        results.append(res)
        if not res.ok:
            break
        if turn + 1 < len(conv.users) and think_time_s > 0:
            await asyncio.sleep(rng.expovariate(1.0 / think_time_s))
    return results
