"""Export a long-sequence Llama-style decoder as an onnxruntime-training graph (the memory
figure of FlashAttention, issue 22): LlamaModel, eager attention, hidden 512, 8 heads / 2 KV
heads, 2 layers, SwiGLU FF 1376, vocabulary 32,000, batch 1, sequence --seq; MSE loss on the
last hidden state (no LM head: the logits' memory is the fused linear + cross-entropy's part);
with --lm-head: LlamaForCausalLM (untied LM head 512 -> 32,000) and the cross-entropy loss of
generate_artifacts (CrossEntropyLoss, mean, ignore_index -100) on the logits viewed [S, V]
(fused by rules/lce_ortt.yaml), written as ortt_llama_lm_S{seq}.onnx.

Run with the corpus generator venv (torch, transformers, onnxruntime-training):
  build/venv-corpus-ortt/bin/python scripts/flash/export_long_decoder.py --seq 2048 --out DIR
Writes DIR/ortt_llama_long_S{seq}.onnx (+ .params.npz). scripts/flash/memory.sh runs it and
then `fusecli bench` on the original and the fused graph.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
import archs  # noqa: E402
import gen  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lm-head", action="store_true")
    ap.add_argument("--family", choices=["ort-training", "torch-joint"], default="ort-training",
                    help="torch-joint (with --lm-head): aot_export of the model and Hugging "
                         "Face's cross-entropy written out (tests/data/make_lce.py's Loss)")
    a = ap.parse_args()
    torch.manual_seed(0)
    head = a.lm_head
    build = archs._hf("LlamaConfig", "LlamaForCausalLM" if head else "LlamaModel",
                      pick=(lambda o: o[0].reshape(-1, 32000)) if head else (lambda o: o[0]),
                      vocab_size=32000, tie_word_embeddings=False, hidden_size=512,
                      intermediate_size=1376, num_hidden_layers=a.layers,
                      num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=a.seq)
    arch = archs.Arch("llama_long", "transformers", "long-sequence Llama decoder", build,
                      lambda: {"input_ids": torch.randint(0, 32000, (1, a.seq))},
                      input_ranges={"input_ids": [0, 32000]})
    model, inputs = archs.make(arch, a.family)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.family == "torch-joint":
        return export_torch(model, inputs, a)
    name = f"ortt_llama_{'lm' if head else 'long'}_S{a.seq}"
    loss = None
    if head:
        from onnxruntime.training import onnxblock

        loss = onnxblock.loss.CrossEntropyLoss(reduction="mean", ignore_index=-100)
    gen.build_ortt(arch, model, inputs, name, a.out, check=False, loss=loss)
    print(a.out / f"{name}.onnx")
    return 0


def export_torch(model, inputs, a) -> int:
    import numpy as np
    import onnx

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "data"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "samples"))
    from gen_torch import export_joint
    from make_lce import Loss

    assert a.lm_head, "torch-joint: only with --lm-head"
    labels = torch.randint(0, 32000, (a.seq,))
    m, values, _ = export_joint(Loss(model, "mean"), [inputs["input_ids"], labels],
                                ["input_ids", "labels"], metadata=False)
    name = f"torch_llama_lm_S{a.seq}"
    onnx.save(m, a.out / f"{name}.onnx", save_as_external_data=False)
    np.savez(a.out / f"{name}.params.npz", **values)
    print(a.out / f"{name}.onnx")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
