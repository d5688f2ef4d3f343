"""Turning a benchmark run's measurements into the table, the issue-2 comparison and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median of the numeric fields of several repetitions."""
    if not runs:
        return {}
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs if key in r)
        else:
            out[key] = value
    out["reps"] = len(runs)
    return out


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if digits == 0 or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def main_table(results: dict[str, dict[str, dict[str, Any]]], concurrency: list[int], streams: list[int]) -> str:
    """One row per peer: req/s, p50/p99 (ms) per concurrency; the proxy's CPU per request (and the kernel's
    part of it: its sockets); stalls, TTFC p50/p99, gap p99 and the proxy's CPU per stream, per stream
    count."""
    head = ["peer"]
    for c in concurrency:
        head += [f"req/s c={c}", f"p50 c={c}", f"p99 c={c}"]
    head.append("CPU µs/req c=16" if 16 in concurrency else "CPU µs/req")
    head.append("of it system")
    for n in streams:
        head += [f"stalled/streams {n}", f"TTFC p50 {n}", f"TTFC p99 {n}", f"gap p99 {n}", f"CPU µs/stream {n}"]
    rows = [head]
    for peer, scen in results.items():
        row = [peer]
        for c in concurrency:
            r = scen.get(f"c{c}", {})
            row += [_fmt(r.get("rps"), 0), _fmt(r.get("p50_ms"), 3), _fmt(r.get("p99_ms"), 2)]
        cpu_at = scen.get("c16") or scen.get(f"c{concurrency[-1]}", {}) if concurrency else {}
        row.append(_fmt(cpu_at.get("cpu_us_per_req"), 1))
        row.append(_fmt(cpu_at.get("sys_us_per_req"), 1))
        for n in streams:
            s = scen.get(f"s{n}", {})
            stalls = f"{s['stalled']:.0f}/{s['streams']:.0f}" + (f" ({s['errors']:.0f} err)" if s.get("errors") else "")
            row += (
                [
                    stalls,
                    _fmt(s.get("ttfc_p50_ms")),
                    _fmt(s.get("ttfc_p99_ms")),
                    _fmt(s.get("gap_p99_ms")),
                    _fmt(s.get("cpu_us_per_stream"), 0),
                ]
                if s
                else ["-"] * 5
            )
        rows.append(row)
    return (
        _markdown(rows) + "\nlatency and gaps in ms; req/s and latency from wrk (1 thread); medians of the repetitions"
    )


def added_latency_table(results: dict[str, dict[str, dict[str, Any]]], baseline: str, concurrency: list[int]) -> str:
    """Issue 2's comparison: what each peer adds to the baseline (direct) in the same run."""
    base = results.get(baseline, {})
    head = ["peer", *[f"added p50 c={c}" for c in concurrency], *[f"added p99 c={c}" for c in concurrency]]
    head += ["max req/s", "added TTFC p50 (streams)", "added TTFC p99 (streams)"]
    rows = [head]
    stream_key = next((k for k in base if k.startswith("s")), None)
    for peer, scen in results.items():
        if peer == baseline:
            continue
        row = [peer]
        for pct in ("p50_ms", "p99_ms"):
            for c in concurrency:
                a, b = scen.get(f"c{c}", {}).get(pct), base.get(f"c{c}", {}).get(pct)
                row.append(_fmt(a - b, 3) if a is not None and b is not None else "-")
        rates = [r["rps"] for k, r in scen.items() if k.startswith("c") and "rps" in r]
        row.append(_fmt(max(rates), 0) if rates else "-")
        for pct in ("ttfc_p50_ms", "ttfc_p99_ms"):
            a = scen.get(stream_key or "", {}).get(pct)
            b = base.get(stream_key or "", {}).get(pct)
            row.append(_fmt(a - b, 3) if a is not None and b is not None else "-")
        rows.append(row)
    label = f" ({stream_key[1:]} streams)" if stream_key else ""
    return _markdown(rows) + f"\nms added over '{baseline}' in the same run{label}"


def memory_table(memory: dict[str, Any]) -> str:
    rows = [["measure", "value"]]
    for key, value in memory.items():
        rows.append([key, _fmt(value, 1) if isinstance(value, float) else str(value)])
    return _markdown(rows)


def _markdown(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(rows[0], widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows[1:]:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict[str, Any]]], concurrency: list[int], path: Path) -> Path | None:
    """Latency (p50 and p99) vs concurrency per peer, log scale. Needs matplotlib (skipped without)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for peer, scen in results.items():
        xs = [c for c in concurrency if f"c{c}" in scen]
        if not xs:
            continue
        for ax, key in zip(axes[:2], ("p50_ms", "p99_ms"), strict=True):
            ax.plot(xs, [scen[f"c{c}"][key] for c in xs], marker="o", label=peer)
        axes[2].plot(xs, [scen[f"c{c}"]["rps"] for c in xs], marker="o", label=peer)
    for ax, title in zip(axes, ("latency p50 (ms)", "latency p99 (ms)", "requests/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.set_xlabel("concurrent connections")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("One core per proxy, mock upstream + load on the other core (medians)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
