"""Engine benchmark: a real vLLM CPU worker with SmolLM2, through the gateway and direct, side by side.

One run starts two managed workers one after the other (``EngineManager``; 2 cores cannot hold both):

1. spec off: continuous batching (output tokens/s, TTFT and TPOT p50/p99 at concurrency 1, 8, 32),
   prefix caching (TTFT of a request sharing a ~1,500-token system prompt with an earlier one, vs a cold
   one with a unique prefix), and the speculative-decoding baseline;
2. spec on (ngram prompt lookup): an input-grounded task (repeat a given code block with one rename) and
   open chat, at concurrency 1 and 32, with the text compared to spec off at temperature 0.

Every request streams with ``include_usage``, ``temperature 0`` and a fixed ``max_tokens`` with
``ignore_eos`` so lengths are equal. A gateway (``gateway serve --no-managed-workers``, routing plugin
only) runs as its own process in front of each worker. Results: bench/results/engine.json and a markdown
table on stdout. The machine's load (``/proc/loadavg``) is recorded before each section: on a shared
machine the numbers move with it.

    .venv/bin/python bench/bench_engine.py            # full, about 15-20 minutes with eager workers
    .venv/bin/python bench/bench_engine.py --quick    # fewer requests, about 6 minutes
    .venv/bin/python bench/bench_engine.py --compiled # workers without --enforce-eager (compiled, slow start)
    .venv/bin/python bench/bench_engine.py --dtype float32  # e.g. to see whether bf16 causes text differences
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gateway.engine.spec import ManagedWorkerSpec  # noqa: E402
from gateway.engine.supervisor import EngineManager  # noqa: E402
from tests.support.fakes import free_port  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_workload import (  # noqa: E402
    MODEL,
    Batch,
    chat_prompts,
    grounded_prompts,
    load,
    long_system_prompt,
    merge,
    pct,
    run_batch,
    stream_one,
)  # fmt: skip

RESULTS = REPO / "bench" / "results" / "engine.json"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


# -- the worker and the gateway -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def managed_worker(speculative: dict[str, Any] | None, enforce_eager: bool, dtype: str) -> AsyncIterator[str]:
    spec = ManagedWorkerSpec.model_validate({
        "name": "bench-spec" if speculative else "bench", "model": MODEL, "served_model_name": MODEL,
        "port": free_port(), "dtype": dtype, "max_model_len": 2048, "kv_cache_space_gb": 2,
        "max_num_seqs": 64, "max_num_batched_tokens": 4096, "enable_prefix_caching": True,
        "enforce_eager": enforce_eager, "speculative": speculative,
    })  # fmt: skip
    engine = EngineManager([spec], models_dir=REPO / "models", ready_timeout_s=900)
    started = time.perf_counter()
    await engine.start()
    print(f"  worker {spec.name} ready in {time.perf_counter() - started:.0f} s at {spec.url}", flush=True)
    try:
        yield spec.url
    finally:
        await engine.stop()


@contextlib.contextmanager
def gateway_process(worker_url: str) -> Iterator[tuple[str, int]]:
    """``gateway serve --no-managed-workers`` in front of ``worker_url``, routing plugin only."""
    port = free_port()
    config = {
        "models": [{"name": MODEL, "workers": [worker_url], "max_model_len": 2048}],
        "plugins": [{"name": "routing"}],
        "upstream": {"first_byte_timeout_s": 600, "idle_timeout_s": 120},
        "logging": {"level": "WARNING", "access_log": False},
    }
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        log = (Path(tmp) / "gateway.log").open("wb")
        env = {**os.environ, "GATEWAY_LOG_LEVEL": "WARNING", "GATEWAY_WORKERS": "1"}
        argv = [str(REPO / ".venv" / "bin" / "gateway"), "serve", "--no-managed-workers",
                "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"gateway exited: {(Path(tmp) / 'gateway.log').read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("gateway not ready within 60 s")
                time.sleep(0.3)
            yield url, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


# -- the sections -------------------------------------------------------------------------------------


@dataclass
class Plan:
    max_tokens: int
    throughput_requests: dict[int, int]
    throughput_reps: int  # each point run this many times per path, alternating which path goes first
    spec_requests: dict[int, int]
    prefix_pairs: int


FULL = Plan(128, {1: 4, 8: 16, 32: 64}, 2, {1: 4, 32: 32}, 5)
QUICK = Plan(128, {1: 2, 8: 8, 32: 32}, 1, {1: 2, 32: 32}, 3)


async def both(
    paths: dict[str, str], prompts: Any, c: int, plan: Plan, first: str, pids: dict[str, int]
) -> dict[str, Batch]:
    """The same batch on each path (own salts so no path reuses the other's cache), ``first`` first."""
    order = sorted(paths, key=lambda p: p != first)
    out: dict[str, Batch] = {}
    for path in order:
        out[path] = await run_batch(paths[path], prompts(path), c, plan.max_tokens, pids.get(path))
        b = out[path]
        print(f"    c={c:<2} {path:<7} {b.tokens_per_s:7.1f} tok/s  TTFT p50 {b.ttft_ms['p50']:7.0f} ms  "
              f"TPOT p50 {b.tpot_ms.get('p50', 0):5.1f} ms  (load {b.load})", flush=True)  # fmt: skip
    return out


async def throughput(paths: dict[str, str], plan: Plan, pids: dict[str, int]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    turn = 0
    for c, n in plan.throughput_requests.items():
        runs: dict[str, list[Batch]] = {p: [] for p in paths}
        for rep in range(plan.throughput_reps):
            # alternate which path goes first so a drift in machine load does not favour one of them
            first = "direct" if turn % 2 == 0 else "gateway"
            turn += 1
            batches = await both(
                paths, lambda p, n=n, c=c, rep=rep: chat_prompts(n, f"tp{c}{p}{rep}"), c, plan, first, pids
            )
            for p, b in batches.items():
                runs[p].append(b)
        result[str(c)] = {
            p: asdict(merge(bs)) | {"texts": None, "ttfts": None, "tpots": None} for p, bs in runs.items()
        }
    return result


async def prefix(paths: dict[str, str], pairs: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        for path, base in paths.items():
            cold, warm = [], []
            for k in range(pairs):
                system = long_system_prompt(uuid.uuid4().hex)
                first = [{"role": "system", "content": system}, {"role": "user", "content": f"Order {k}?"}]
                again = [{"role": "system", "content": system}, {"role": "user", "content": f"Ledger {k + 1}?"}]
                cold.append((await stream_one(client, base, first, 4)).ttft * 1000)
                warm.append((await stream_one(client, base, again, 4)).ttft * 1000)
            result[path] = {
                "cold_ttft_ms_p50": round(pct(cold, 50), 1), "warm_ttft_ms_p50": round(pct(warm, 50), 1),
                "cold": [round(x) for x in cold], "warm": [round(x) for x in warm], "load": load(),
            }  # fmt: skip
            r = result[path]
            print(f"    prefix {path:<7} cold {r['cold_ttft_ms_p50']:.0f} ms  warm {r['warm_ttft_ms_p50']:.0f} ms",
                  flush=True)  # fmt: skip
    return result


async def speculative_tasks(paths: dict[str, str], plan: Plan, pids: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tasks = {"grounded": grounded_prompts, "chat": chat_prompts}
    for task, make in tasks.items():
        for c, n in plan.spec_requests.items():
            # per path its own prompts (no path profits from the other's prefix cache), the same ones in
            # both worker configs, so spec on and off can be compared text for text
            batches = await both(paths, lambda p, n=n, make=make: make(n, f"spec-{p}"), c, plan, "direct", pids)
            out[f"{task}/{c}"] = {p: asdict(b) for p, b in batches.items()}
    return out


async def with_worker(speculative: dict[str, Any] | None, eager: bool, dtype: str, sections: Any) -> Any:
    async with managed_worker(speculative, eager, dtype) as worker_url:
        with gateway_process(worker_url) as (gateway_url, gateway_pid):
            paths = {"direct": worker_url, "gateway": gateway_url}
            await run_batch(worker_url, chat_prompts(2, "warm" + uuid.uuid4().hex), 2, 16)  # warm-up
            await run_batch(gateway_url, chat_prompts(2, "warm" + uuid.uuid4().hex), 2, 16)
            return await sections(paths, {"gateway": gateway_pid})


# -- the report ---------------------------------------------------------------------------------------


def match_rate(off: list[str], on: list[str]) -> float:
    return sum(a == b for a, b in zip(off, on, strict=True)) / len(off)


def shared_start(off: list[str], on: list[str]) -> float:
    """Mean share of each spec-off text that spec on reproduces before the first difference."""
    shares = []
    for a, b in zip(off, on, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        shares.append(same / max(1, len(a)))
    return sum(shares) / len(shares)


def analyse(report: dict[str, Any]) -> dict[str, Any]:
    tp, off, on = report["throughput"], report["spec_off"], report["spec_on"]
    spec: dict[str, Any] = {}
    for key in off:
        for path in off[key]:
            a, b = off[key][path], on[key][path]
            spec[f"{key}/{path}"] = {
                "off_tok_s": a["tokens_per_s"], "on_tok_s": b["tokens_per_s"],
                "speedup": round(b["tokens_per_s"] / a["tokens_per_s"], 2),
                "off_ttft_p50": a["ttft_ms"]["p50"], "on_ttft_p50": b["ttft_ms"]["p50"],
                "off_tpot_p50": a["tpot_ms"].get("p50"), "on_tpot_p50": b["tpot_ms"].get("p50"),
                "identical": round(match_rate(a["texts"], b["texts"]), 2),
                "same_until_diverged": round(shared_start(a["texts"], b["texts"]), 2),
            }  # fmt: skip
    scaling = {p: round(tp["32"][p]["tokens_per_s"] / tp["1"][p]["tokens_per_s"], 2) for p in ("direct", "gateway")}
    overhead = round(tp["32"]["gateway"]["tokens_per_s"] / tp["32"]["direct"]["tokens_per_s"], 3)
    grounded = {p: spec[f"grounded/1/{p}"] for p in ("direct", "gateway")}
    targets = [
        ("c=32 tok/s >= 6x c=1 (direct / gateway)", f"{scaling['direct']}x / {scaling['gateway']}x",
         min(scaling.values()) >= 6),
        ("ngram >= 1.8x tok/s at c=1, grounded (direct / gateway)",
         f"{grounded['direct']['speedup']}x / {grounded['gateway']['speedup']}x",
         min(g["speedup"] for g in grounded.values()) >= 1.8),
        ("ngram output identical at temperature 0, grounded c=1",
         f"{grounded['direct']['identical']:.0%} / {grounded['gateway']['identical']:.0%}",
         min(g["identical"] for g in grounded.values()) == 1),
        ("gateway tok/s at c=32 >= 97% of direct", f"{overhead:.1%}", overhead >= 0.97),
    ]  # fmt: skip
    return {"spec": spec, "scaling": scaling, "gateway_over_direct_c32": overhead,
            "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in targets]}  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    tp, a, meta = report["throughput"], report["analysis"], report["meta"]
    lines = [
        f"SmolLM2-135M-Instruct, vLLM {meta['vllm']} on the CPU ({meta['cores']} cores, {meta['dtype']}, "
        f"{'eager' if meta['enforce_eager'] else 'compiled'}), max_tokens {meta['max_tokens']} with ignore_eos, "
        f"temperature 0, streamed. Load average at start {meta['load_start']}, end {meta['load_end']} "
        f"(shared machine). {'Quick run.' if meta['quick'] else ''}",
        "Gateway CPU: CPU seconds the gateway process used per second of the run; on this 2-core host it is "
        "taken from the worker.",
        "",
        "| concurrency | direct tok/s | gateway tok/s | gateway/direct | TTFT p50/p99 ms direct | gateway "
        "| TPOT p50/p99 ms direct | gateway | gateway CPU (cores) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c, row in tp.items():
        d, g = row["direct"], row["gateway"]
        lines.append(
            f"| {c} | {d['tokens_per_s']} | {g['tokens_per_s']} | {g['tokens_per_s'] / d['tokens_per_s']:.1%} "
            f"| {d['ttft_ms']['p50']:.0f} / {d['ttft_ms']['p99']:.0f} "
            f"| {g['ttft_ms']['p50']:.0f} / {g['ttft_ms']['p99']:.0f} "
            f"| {d['tpot_ms']['p50']} / {d['tpot_ms']['p99']} | {g['tpot_ms']['p50']} / {g['tpot_ms']['p99']} "
            f"| {g['proxy_cpu_share']} |"
        )
    lines += ["", "| ngram speculation | path | tok/s off | tok/s on | speedup | TPOT p50 ms off / on "
              "| TTFT p50 ms off / on | identical text | same before first difference |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, s in a["spec"].items():
        task, c, path = key.split("/")
        lines.append(f"| {task}, c={c} | {path} | {s['off_tok_s']} | {s['on_tok_s']} | {s['speedup']}x "
                     f"| {s['off_tpot_p50']} / {s['on_tpot_p50']} | {s['off_ttft_p50']:.0f} / {s['on_ttft_p50']:.0f} "
                     f"| {s['identical']:.0%} | {s['same_until_diverged']:.0%} |")  # fmt: skip
    lines += ["", "| prefix caching (~1,500-token system prompt) | cold TTFT p50 ms | shared-prefix TTFT p50 ms "
              "| speedup |", "|---|---|---|---|"]  # fmt: skip
    for path, p in report["prefix"].items():
        lines.append(f"| {path} | {p['cold_ttft_ms_p50']:.0f} | {p['warm_ttft_ms_p50']:.0f} "
                     f"| {p['cold_ttft_ms_p50'] / p['warm_ttft_ms_p50']:.1f}x |")  # fmt: skip
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |" for t in a["targets"]]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import vllm

    plan = QUICK if args.quick else FULL
    eager = not args.compiled
    report: dict[str, Any] = {"meta": {
        "vllm": vllm.__version__, "cores": os.cpu_count(), "enforce_eager": eager, "dtype": args.dtype,
        "quick": args.quick, "max_tokens": plan.max_tokens, "load_start": load(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }}  # fmt: skip
    began = time.perf_counter()

    async def spec_off(paths: dict[str, str], pids: dict[str, int]) -> None:
        print("  continuous batching", flush=True)
        report["throughput"] = await throughput(paths, plan, pids)
        print("  prefix caching", flush=True)
        report["prefix"] = await prefix(paths, plan.prefix_pairs)
        print("  speculative decoding baseline (off)", flush=True)
        report["spec_off"] = await speculative_tasks(paths, plan, pids)

    async def spec_on(paths: dict[str, str], pids: dict[str, int]) -> None:
        print("  speculative decoding (ngram on)", flush=True)
        report["spec_on"] = await speculative_tasks(paths, plan, pids)

    print(f"worker 1/2: speculation off (load {load()})", flush=True)
    await with_worker(None, eager, args.dtype, spec_off)
    print(f"worker 2/2: ngram speculation (load {load()})", flush=True)
    await with_worker(NGRAM, eager, args.dtype, spec_on)
    report["meta"] |= {"load_end": load(), "duration_s": round(time.perf_counter() - began)}
    report["analysis"] = analyse(report)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests per point")
    parser.add_argument("--compiled", action="store_true", help="compiled workers (no --enforce-eager)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="worker dtype")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the workers' log lines")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    report = asyncio.run(main_async(args))
    for section in ("spec_off", "spec_on"):  # keep the texts out of the JSON's bulk, but keep one example
        for row in report[section].values():
            for batch in row.values():
                batch["example"] = batch.pop("texts")[0][:200]
                del batch["ttfts"], batch["tpots"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out} ({report['meta']['duration_s']} s)\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
