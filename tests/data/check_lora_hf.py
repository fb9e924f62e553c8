"""peft LoRA on the corpus's tiny Hugging Face configs (scripts/corpus/archs.py), not committed as
fixtures: `VENV/bin/python tests/data/check_lora_hf.py FAMILY ARCH TARGETS` (e.g. ort-training
llama q_proj,v_proj; torch-joint bert query,value; the venvs of make_lora.py) writes
build/hf_lora/<prefix>_<arch>_lora.onnx through the corpus exporters and prints the number of
LoRA-wrapped layers (from the model); then `fusecli optimize` and `fusecli verify` it."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "corpus"))
import gen  # noqa: E402
from archs import ARCHS, make  # noqa: E402


def main(family: str, name: str, targets: str) -> None:
    from peft import LoraConfig, get_peft_model

    arch = ARCHS[name]
    torch.manual_seed(0)
    model, inputs = make(arch, family)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets.split(","), lora_dropout=0.0,
                     init_lora_weights=False)
    inner = get_peft_model(model, cfg).base_model.model
    n = sum(1 for m in inner.modules() if getattr(m, "lora_A", None))
    builder = gen.build_ortt if family == "ort-training" else gen.build_torch
    out = ROOT / "build" / "hf_lora"
    out.mkdir(parents=True, exist_ok=True)
    res = builder(arch, inner, inputs, f"{gen.PREFIX[family]}_{name}_lora", out, True)
    print(f"{name} {family}: {n} LoRA layers; max |grad - torch| "
          f"{res['max_abs_grad_err_vs_torch']:.3g} (dropout models differ from torch's masks)")


if __name__ == "__main__":
    main(*sys.argv[1:4])
