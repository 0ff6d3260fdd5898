"""The torchrun-compatible launch (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, env://
rendezvous): two processes run the same `mambaserve generate` command; RANK 0 is the engine and
prints, RANK 1 builds the engine, serves rank 0's steps as a worker and exits 0 when rank 0
stops. The text equals the one-rank run's. This is the code path multi-node serving takes
(docs/architecture.md), here on one host with gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from mambaserve import LLM, SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_env_launched_ranks_generate_like_one(tiny_ckpt):
    argv = [sys.executable, "-m", "mambaserve.cli", "generate", "--model", str(tiny_ckpt),
            "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32",
            "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "hello world"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": "2", "MAMBASERVE_TP_TIMEOUT_S": "60"}
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    llm = LLM(tiny_ckpt, dtype="float32", device="cpu")
    want = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=8,
                                                      ignore_eos=True))[0]
    assert outs[0][0].startswith("hello world" + want.outputs[0].text + "\n")
    assert outs[1][0] == ""  # rank 1 prints nothing of its own
