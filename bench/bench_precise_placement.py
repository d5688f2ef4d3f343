"""What precise_prefix adds per request, in-process: tokenizing the prompt with the model's tokenizer and
chat template, hashing its full blocks as vLLM does, and scoring the candidates against the KV index;
side by side, the scoring with what cold placement adds (each worker's blocks on their way and its
recent working set) and the recording of the placement (its demand and pending blocks).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_precise_placement.py [--model-dir models/smollm2]

Prompts of several lengths (a system prompt and a question); per length the median and p99 of each
step in microseconds, over ``--reps`` requests, with an index of ``--entries`` (worker, block) entries
over two workers. Prompts over the policy's ``thread_above_chars`` are tokenized in a thread in the
gateway: the figure is then CPU taken from the process, not time the event loop waits.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

from gateway.upstream.kv_index import BYTES_PER_ENTRY, BlockIndex
from plugins.routing.blockhash import BlockHasher
from plugins.routing.pending import PendingBlocks
from plugins.routing.prompt_tokens import PromptTokenizer
from plugins.routing.scorers import Candidate, Weights, rank

WORDS = ["shipping", "parcel", "policy", "refund", "address", "customs", "delivery", "courier", "label", "warehouse"]


def body(chars: int, rng: random.Random) -> dict[str, object]:
    text = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        text.append(word)
        size += len(word) + 1
    question = f"Question {rng.randrange(10**6)}: where is my parcel?"
    return {"messages": [{"role": "system", "content": " ".join(text)}, {"role": "user", "content": question}]}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default="models/smollm2")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--block-size", type=int, default=128)
    args = parser.parse_args()
    tokenizer = asyncio.run(PromptTokenizer.load(str(Path(args.model_dir))))
    hasher = BlockHasher("sha256", None, args.block_size)
    rng = random.Random(1)
    index = BlockIndex(args.entries)
    workers = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    for i in range(args.entries):
        index.store(workers[i % 2], [rng.getrandbits(64)])
    print(f"index: {len(index)} entries, bound {args.entries * BYTES_PER_ENTRY / 2**20:.0f} MiB "
          f"({BYTES_PER_ENTRY} bytes/entry)")  # fmt: skip
    demand = BlockIndex(2 * 4096)  # two workers' caches of 4,096 blocks: full, as in steady state
    for i in range(demand.max_entries):
        demand.store(workers[i % 2], [rng.getrandbits(64)])
    pending = PendingBlocks(60.0, args.entries)
    print(f"{'prompt chars':>12} {'tokens':>7} {'blocks':>6} | {'tokenize p50/p99 us':>20} | "
          f"{'hash p50/p99 us':>16} | {'score p50/p99 us':>16} | {'+cold p50/p99 us':>16} | "
          f"{'record p50/p99 us':>17} | {'total p50 us':>12}")  # fmt: skip
    for chars in (200, 2_000, 8_000, 32_000):
        bodies = [body(chars, rng) for _ in range(args.reps)]
        tok_t, hash_t, score_t, cold_t, record_t = [], [], [], [], []
        n_tokens = n_blocks = 0
        for b in bodies:
            t0 = time.perf_counter()
            tokens = tokenizer.tokens("chat/completions", b)
            t1 = time.perf_counter()
            assert tokens is not None
            hashes = hasher.hashes(tokens)
            t2 = time.perf_counter()
            candidates = [Candidate(w, index.prefix_blocks(w, hashes), 1, 2.0, 0.0, 0.3) for w in workers]
            rank(candidates, len(hashes), Weights())
            t3 = time.perf_counter()
            candidates = [
                Candidate(
                    w, pending.extend(w, hashes, index.prefix_blocks(w, hashes)), 1, 2.0, 0.0, 0.3, demand.blocks(w)
                )
                for w in workers
            ]
            best = rank(candidates, len(hashes), Weights())[0][1]
            t4 = time.perf_counter()
            demand.store(best.key, hashes)
            pending.add(best.key, hashes[best.prefix_blocks :])
            t5 = time.perf_counter()
            tok_t.append((t1 - t0) * 1e6)
            hash_t.append((t2 - t1) * 1e6)
            score_t.append((t3 - t2) * 1e6)
            cold_t.append((t4 - t3) * 1e6)
            record_t.append((t5 - t4) * 1e6)
            n_tokens, n_blocks = len(tokens), len(hashes)
        total = [sum(t) for t in zip(tok_t, hash_t, cold_t, record_t, strict=True)]
        print(
            f"{chars:>12} {n_tokens:>7} {n_blocks:>6} | {statistics.median(tok_t):>9.0f} /{pct(tok_t, 0.99):>9.0f} | "
            f"{statistics.median(hash_t):>7.0f} /{pct(hash_t, 0.99):>7.0f} | "
            f"{statistics.median(score_t):>7.0f} /{pct(score_t, 0.99):>7.0f} | "
            f"{statistics.median(cold_t):>7.0f} /{pct(cold_t, 0.99):>7.0f} | "
            f"{statistics.median(record_t):>8.0f} /{pct(record_t, 0.99):>7.0f} | {statistics.median(total):>12.0f}"
        )


if __name__ == "__main__":
    main()
