"""Instructions per request by C function, for peers side by side, from the profiles that
``bench/bench_request_path.py --instructions --callgrind-out PREFIX`` keeps.

Each peer ran for N and for 2N requests; a function's count in the longer run minus the shorter, over N,
is what it costs per request with start-up left out. The functions are CPython's, the C extensions'
and libc's, not Python's own (a Python function runs inside ``_PyEval_EvalFrameDefault``), so this says
where the instructions go by kind of work: the interpreter itself, regular expressions, hashing,
packing Redis commands, the event loop's reads and writes. Sorted by how much more the first peer
spends than the second.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_request_path.py --instructions --peers production,routing \\
        --callgrind-out /tmp/cg
    .venv/bin/python bench/callgrind_diff.py /tmp/cg production routing [--inclusive] [--top 40]

Needs ``callgrind_annotate`` (valgrind's).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

_LINE = re.compile(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)$")
_BUILD_DIR = re.compile(r"^/tmp/python-build[^/]*/Python-[\d.]+/")  # pyenv's build tree: keep the file in it
_OBJECT = re.compile(r" \[[^\]]*\]$")  # the shared object a function is in


def function_counts(profile: Path, inclusive: bool) -> dict[str, int]:
    """Instructions per function (file:function) in one callgrind profile."""
    out = subprocess.run(
        ["callgrind_annotate", f"--inclusive={'yes' if inclusive else 'no'}", "--threshold=100", str(profile)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counts: dict[str, int] = {}
    for line in out.splitlines():
        match = _LINE.match(line)
        if match is None or "PROGRAM TOTALS" in line:
            continue
        name = _OBJECT.sub("", _BUILD_DIR.sub("", match.group(2).strip()))
        counts[name] = counts.get(name, 0) + int(match.group(1).replace(",", ""))
    return counts


def per_request(prefix: str, peer: str, inclusive: bool) -> dict[str, float]:
    """(count in the 2N run - count in the N run) / N, per function, for ``peer``'s two profiles."""
    runs = sorted(Path(prefix).parent.glob(f"{Path(prefix).name}.{peer}.*.out"), key=lambda p: int(p.suffixes[-2][1:]))
    if len(runs) != 2:
        raise SystemExit(f"expected two profiles {prefix}.{peer}.<N>.out and .<2N>.out, found {len(runs)}")
    short, long = (function_counts(path, inclusive) for path in runs)
    requests = int(runs[1].suffixes[-2][1:]) - int(runs[0].suffixes[-2][1:])
    return {name: (long.get(name, 0) - short.get(name, 0)) / requests for name in short.keys() | long.keys()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix")
    parser.add_argument("peers", nargs="+", help="peer names as the profiles have them (production, routing@base)")
    parser.add_argument("--inclusive", action="store_true", help="count what each function calls too")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    tables = [per_request(args.prefix, peer, args.inclusive) for peer in args.peers]
    first, second = tables[0], tables[1] if len(tables) > 1 else {}
    names = sorted(first.keys() | second.keys(), key=lambda n: second.get(n, 0) - first.get(n, 0))
    print(" | ".join(f"{peer:>14s}" for peer in args.peers) + " | function")
    for name in names[: args.top]:
        print(" | ".join(f"{table.get(name, 0):14,.0f}" for table in tables) + f" | {name[:110]}")
    if not args.inclusive:
        print(" | ".join(f"{sum(table.values()):14,.0f}" for table in tables) + " | all functions")


if __name__ == "__main__":
    main()
