"""Export a BERT encoder fine-tuned with LoRA at batch 1, with attention dropout, as a
torch-joint training graph (BENCHMARKS.md, "Attention dropout under LoRA at batch 1"):

  transformers' BertModel (no pooler), eager attention, hidden 768, 12 heads, FF 3072,
  --layers layers (default 2), vocabulary 30,522, BERT's default dropout 0.1 (hidden states and
  attention probabilities); peft LoRA r 8 on query / value (every base parameter frozen);
  batch 1, sequence --seq (default 512), an all-ones attention mask; MSE of the last hidden
  state against a target (scripts/corpus/gen.py's build_torch).

Attention dropout keeps the attention out of the flash rules (the sdpa rules take it). At batch 1
the first layer, which has no dK, has its dS view folded into the dQ MatMul by the exporter.

The dropout masks of torch and onnxruntime differ, so the export is checked against torch
autograd through its twin with every dropout probability 0 (as gen.py does for Arch.dropout).
Writes DIR/torch_bert_lora_b1_S{seq}.onnx (+ .params.npz). Run with build/venv-corpus-torch
(torch 2.13, transformers, peft):

  build/venv-corpus-torch/bin/python scripts/flash/export_bert_lora.py --out build/bert-lora
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
import gen  # noqa: E402

VOCAB = 30522


class LastHidden(torch.nn.Module):
    """(ids, mask) -> the encoder's last hidden state."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, ids, mask):
        return self.net(input_ids=ids, attention_mask=mask).last_hidden_state


def main() -> int:
    import transformers
    from peft import LoraConfig, get_peft_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=768, num_hidden_layers=a.layers,
                                  num_attention_heads=12, intermediate_size=3072,
                                  max_position_embeddings=max(512, a.seq))
    cfg._attn_implementation = "eager"
    net = transformers.BertModel(cfg, add_pooling_layer=False)
    net = get_peft_model(net, LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"],
                                         init_lora_weights=False)).base_model.model
    model = LastHidden(net).train()
    inputs = {"ids": torch.randint(0, VOCAB, (1, a.seq)),
              "mask": torch.ones(1, a.seq, dtype=torch.long)}
    name = f"torch_bert_lora_b1_S{a.seq}"
    arch = types.SimpleNamespace(library="torch", name=name,
                                 input_ranges={"ids": (0, VOCAB), "mask": (1, 2)})
    err = gen.dropout_twin_error(gen.build_torch, arch, model, inputs)
    a.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    gen.build_torch(arch, model, inputs, name, a.out, False)
    print(f"{a.out / name}.onnx: max |grad - torch| {err:.3g} (the dropout-free twin)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
