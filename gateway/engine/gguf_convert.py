"""Convert a GGUF file into a Hugging Face model directory that vLLM serves.

Run as a program, in the interpreter that has the engine extra installed (transformers, gguf, accelerate,
torch)::

    python -m gateway.engine.gguf_convert SRC.gguf OUT_DIR [--dtype bfloat16]

It runs in its own process so that the gateway never imports torch and the memory of the dequantized
weights is returned to the system when it ends. transformers dequantizes the GGUF tensors on load;
``save_pretrained`` refuses a model it believes is quantized, so the GGUF quantizer marker
(``model.hf_quantizer`` and ``config.quantization_config``) is dropped first: the weights in memory are
plain floats by then. The output has safetensors weights, the tokenizer, a chat template and a
generation config. Exit status 0 on success; on failure a one-line reason on stderr and status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# ChatML, what SmolLM2-Instruct uses; written only if the GGUF carries no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def convert(gguf_file: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Write the HF directory for ``gguf_file`` into ``out_dir`` (created; expected to be empty)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source_dir, name = str(gguf_file.parent), gguf_file.name
    print(f"loading tokenizer from {name}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name)
    print(f"loading and dequantizing {name}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=name)
    setattr(model, "hf_quantizer", None)  # noqa: B010 - the attribute is typed as a tensor or module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(getattr(torch, dtype))

    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    generation = model.generation_config or GenerationConfig()
    if generation.eos_token_id is None and tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id

    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"writing safetensors ({dtype}) to {out_dir}", flush=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    generation.save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    try:
        convert(args.gguf_file, args.out_dir, args.dtype)
    except ImportError as exc:
        print(
            f"missing engine dependency: {exc}. Install them with: pip install 'vllm-gateway[engine]' "
            "(transformers, gguf, accelerate, torch)",
            file=sys.stderr,
        )
        return 1
    except Exception as exc:
        print(f"conversion failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
