"""bench/callgrind_diff.py: per-request instructions by function, from a peer's two callgrind profiles
(N and 2N requests), read through valgrind's own ``callgrind_annotate``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("callgrind_annotate") is None, reason="valgrind is not installed")


def _profile(path: Path, work: int, caller: int) -> None:
    """A callgrind profile in which ``caller`` (``caller`` instructions of its own) calls ``work``."""
    path.write_text(
        "# callgrind format\nversion: 1\ncreator: test\nevents: Ir\nfl=lib.c\n"
        f"fn=work\n1 {work}\nfn=caller\n1 {caller}\ncfn=work\ncalls=1 1\n1 {work}\n"
    )


@pytest.fixture
def prefix(tmp_path: Path) -> str:
    _profile(tmp_path / "cg.production.10.out", work=1_000, caller=10)
    _profile(tmp_path / "cg.production.20.out", work=3_000, caller=30)  # +200 and +2 per extra request
    _profile(tmp_path / "cg.routing.10.out", work=500, caller=10)
    _profile(tmp_path / "cg.routing.20.out", work=600, caller=10)  # +10 and +0
    return str(tmp_path / "cg")


def test_each_function_costs_the_difference_of_the_two_runs_over_the_extra_requests(prefix: str) -> None:
    diff = load_script(REPO / "bench" / "callgrind_diff.py")
    assert diff.per_request(prefix, "production", inclusive=False) == {"lib.c:work": 200.0, "lib.c:caller": 2.0}
    assert diff.per_request(prefix, "routing", inclusive=False) == {"lib.c:work": 10.0, "lib.c:caller": 0.0}
    assert diff.per_request(prefix, "production", inclusive=True)["lib.c:caller"] == 202.0


def test_the_table_puts_the_peers_side_by_side(
    prefix: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    diff = load_script(REPO / "bench" / "callgrind_diff.py")
    monkeypatch.setattr("sys.argv", ["callgrind_diff.py", prefix, "production", "routing"])
    diff.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["200", "|", "10", "|", "lib.c:work"]  # the largest difference first
    assert lines[-1].split()[:3] == ["202", "|", "10"]


def test_a_missing_profile_is_named(prefix: str) -> None:
    diff = load_script(REPO / "bench" / "callgrind_diff.py")
    with pytest.raises(SystemExit, match=r"cg\.safety"):
        diff.per_request(prefix, "safety", inclusive=False)
