"""Export a long-sequence decoder with its language-model head and cross-entropy loss as a
training graph of either family (the memory table of issue 22):

  --arch llama  LlamaForCausalLM, eager attention, hidden 512, 8 heads / 2 KV heads (GQA via
                repeat_kv), 2 layers, SwiGLU FF 1376, vocabulary 32,000, untied LM head
  --arch gpt2   GPT2LMHeadModel, eager attention, n_embd 384, 6 heads, 2 layers, vocabulary
                50,257, LM head tied to the token embedding, dropout 0
  --arch falcon FalconForCausalLM, eager attention, hidden 512, 8 heads on ONE kv head
                (multi-query: K / V broadcast by the matmuls), parallel attention + MLP, 2
                layers, vocabulary 32,000, LM head tied
  --arch mpt    MptForCausalLM, hidden 512, 8 heads, ALiBi added to the scores before the
                causal masked_fill, 2 layers, expansion 4, vocabulary 32,000, LM head tied
  --arch bloom  BloomForCausalLM, hidden 512, 8 heads, ALiBi through baddbmm on [B * H, S, D]
                views, then the [B, H] view and the additive causal mask, 2 layers, vocabulary
                32,000 (BLOOM's own is 250,880), LM head tied
  batch 1, sequence --seq; loss = mean cross-entropy of the logits [B*S, V] against random
  labels (every token counts).

  --family ortt   onnxruntime-training artifacts (generate_artifacts, CrossEntropyLoss on the
                  logits): SoftmaxCrossEntropyLoss + its Grad; run with build/venv-corpus-ortt
  --family torch  torch-joint graph (aot_export_module(trace_joint=True) of the model and
                  Hugging Face's loss written out, tests/data/make_lce.py's Loss, then the
                  torch.onnx dynamo export): log_softmax, the -100 mask, gather, mean; run
                  with build/venv-corpus-torch

Writes DIR/{family}_{arch}_long_S{seq}.onnx (+ .params.npz). scripts/flash/memory.sh runs it
and then `fusecli bench` on the original and the fused graph. --artifacts (ortt): also keeps
onnxruntime-training's checkpoint and optimizer model, DIR/{name}.artifacts/, to train the
graph through onnxruntime.training.api (scripts/flash/budget_train.py). --loss own (ortt): the
model computes its own loss from a labels input (transformers' ForCausalLMLoss: labels shifted
and padded with -100 in the graph), generate_artifacts(loss=None); DIR/ortt_{arch}_ownloss_...
--loss reducemean (torch): the mean over tokens a ReduceMean; DIR/torch_{arch}_reducemean_...
--loss smoothed (torch): the written-out loss with label smoothing 0.1 (gen_torch.cross_entropy:
(1 - eps) nll + eps * the mean over classes of -log_softmax); DIR/torch_{arch}_smoothed_...
--loss shift (torch): Hugging Face's older causal-LM loss on the shifted logits written out;
DIR/torch_{arch}_shift_...
--loss items (torch): the model's own loss with num_items_in_batch (transformers' ForCausalLMLoss:
labels shifted and padded in the graph, F.cross_entropy(reduction='sum') / the count; the spelling
torch 2.13 exports with right gradients); DIR/torch_{arch}_items_...
--lora: peft LoRA r 8 on the attention's query and value projections (Llama q_proj / v_proj,
GPT-2 c_attn), every base parameter frozen, the LM head included (needs peft); NAME with '_lora'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "samples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "data"))
import gen  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# (input_ids, labels) -> a Hugging Face causal LM's own loss (ForCausalLMLoss: the labels
# shifted and padded with -100 inside the graph, mean over kept tokens)
from make_lce_spellings import HFLoss, _hf_items, _shift_logits  # noqa: E402

VOCAB = {"llama": 32000, "gpt2": 50257, "falcon": 32000, "mpt": 32000, "bloom": 32000}


def _config(arch: str, seq: int, layers: int, attn: str = "eager"):
    import transformers

    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB[arch], hidden_size=512,
                                       intermediate_size=1376, num_hidden_layers=layers,
                                       num_attention_heads=8, num_key_value_heads=2,
                                       max_position_embeddings=seq, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    elif arch == "falcon":
        cfg = transformers.FalconConfig(vocab_size=VOCAB[arch], hidden_size=512,
                                        num_hidden_layers=layers, num_attention_heads=8,
                                        multi_query=True, parallel_attn=True, alibi=False,
                                        max_position_embeddings=seq, hidden_dropout=0.0,
                                        attention_dropout=0.0)
        cls = transformers.FalconForCausalLM
    elif arch == "mpt":
        cfg = transformers.MptConfig(vocab_size=VOCAB[arch], d_model=512, n_heads=8,
                                     n_layers=layers, expansion_ratio=4, max_seq_len=seq,
                                     resid_pdrop=0.0, emb_pdrop=0.0)
        cls = transformers.MptForCausalLM
    elif arch == "bloom":
        cfg = transformers.BloomConfig(vocab_size=VOCAB[arch], hidden_size=512, n_head=8,
                                       n_layer=layers, hidden_dropout=0.0, attention_dropout=0.0)
        cls = transformers.BloomForCausalLM
    else:
        cfg = transformers.GPT2Config(vocab_size=VOCAB[arch], n_embd=384, n_head=6,
                                      n_layer=layers, n_positions=seq, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)
        cls = transformers.GPT2LMHeadModel
    cfg._attn_implementation = attn
    return cls(cfg).train()


class ReduceMeanLoss(torch.nn.Module):
    """(input_ids, labels) -> mean over tokens of -log_softmax(logits)[label], the mean a
    ReduceMean (no -100 mask): the spelling of a hand-written token loss."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, input_ids, labels):
        lp = torch.log_softmax(self.net(input_ids), -1)
        return ((-lp.gather(1, labels[:, None]).squeeze(1)).mean(),)


class ShiftLoss(torch.nn.Module):
    """(input_ids, labels) -> Hugging Face's older causal-LM loss written out on the shifted
    logits (make_lce_spellings.py's shift_logits): log_softmax(logits[:, :-1]) against
    labels[:, 1:], the -100 mask, the kept tokens' mean (the per-token losses reduced by the
    graph)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, input_ids, labels):
        return (_shift_logits(self.net(input_ids=input_ids).logits,
                              labels.reshape(input_ids.shape)),)


class ItemsLoss(torch.nn.Module):
    """(input_ids, labels) -> the model's own loss given num_items_in_batch (make_lce_spellings.py
    hf_llama_items)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, input_ids, labels):
        return (_hf_items(self.net, input_ids, labels.reshape(input_ids.shape)),)


class Logits(torch.nn.Module):
    """input_ids -> logits [B*S, V] (the ort-training loss block takes 2-D logits)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, input_ids):
        logits = self.net(input_ids=input_ids).logits
        return logits.reshape(-1, logits.shape[-1])


def _ortt(model: torch.nn.Module, ids: torch.Tensor, name: str, dest: Path,
          keep: bool = False, own_loss: bool = False) -> None:
    import io
    import shutil
    import tempfile

    import numpy as np
    import onnx
    from onnxruntime.training import artifacts

    gen._mask_without_vmap()
    f = io.BytesIO()
    net = HFLoss(model) if own_loss else Logits(model)
    args = (ids, torch.randint(0, model.config.vocab_size, ids.shape)) if own_loss else (ids,)
    torch.onnx.export(net, args, f, input_names=["input_ids", "labels"][:len(args)],
                      output_names=["loss" if own_loss else "output"],
                      opset_version=16, do_constant_folding=False,
                      training=torch.onnx.TrainingMode.TRAINING, dynamo=False)
    fwd = onnx.load_from_string(f.getvalue())
    inits = {i.name: i for i in fwd.graph.initializer}
    named = dict(net.named_parameters())
    trainable = [n for n in named if n in inits]
    frozen = [n for n in inits if n not in trainable]
    with tempfile.TemporaryDirectory() as td:
        artifacts.generate_artifacts(fwd, requires_grad=trainable, frozen_params=frozen,
                                     loss=None if own_loss else
                                     artifacts.LossType.CrossEntropyLoss,
                                     optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=td)
        m = onnx.load(Path(td) / "training_model.onnx")
        if keep:
            kept = dest / f"{name}.artifacts"
            kept.mkdir(exist_ok=True)
            for f in Path(td).glob("checkpoint*"):  # a file, or with its data beside it
                (shutil.copytree if f.is_dir() else shutil.copy)(f, kept / f.name)
            opt = onnx.load(Path(td) / "optimizer_model.onnx")
            opt.ir_version = min(opt.ir_version, 10)  # what onnxruntime-training 1.19.2 reads
            onnx.save(opt, kept / "optimizer_model.onnx")
    onnx.save(m, dest / f"{name}.onnx")
    names = {i.name for i in m.graph.input}
    np.savez(dest / f"{name}.params.npz",
             **{n: onnx.numpy_helper.to_array(t) for n, t in inits.items() if n in names})


def _torch(model: torch.nn.Module, ids: torch.Tensor, name: str, dest: Path,
           loss: str = "block") -> None:
    import numpy as np
    import onnx

    from gen_torch import export_joint
    from make_lce import Loss  # Hugging Face's loss written out (F.cross_entropy's joint export
                               # has wrong gradients in torch 2.13: shared/notes)

    vocab = model.config.vocab_size
    labels = torch.randint(0, vocab, ids.reshape(-1).shape)
    mod = (ReduceMeanLoss(Logits(model)) if loss == "reducemean" else
           ShiftLoss(model) if loss == "shift" else ItemsLoss(model) if loss == "items" else
           Loss(Logits(model), "mean", 0.1 if loss == "smoothed" else 0.0))
    m, values, _ = export_joint(mod, [ids, labels], ["input_ids", "labels"], metadata=False)
    onnx.save(m, dest / f"{name}.onnx")
    np.savez(dest / f"{name}.params.npz", **values)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=sorted(VOCAB), default="llama")
    ap.add_argument("--family", choices=["ortt", "torch"], default="ortt")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--loss", choices=["block", "own", "reducemean", "smoothed", "shift",
                                       "items"],
                    default="block",
                    help="ortt: 'block' = generate_artifacts' CrossEntropyLoss on the logits; "
                    "'own' = the model's own loss from labels (shift and -100 padding inside "
                    "the graph), written NAME with '_ownloss'; torch: 'block' = Hugging "
                    "Face's loss written out (sum over kept tokens / their count), "
                    "'reducemean' = a ReduceMean over tokens, NAME with '_reducemean'; "
                    "'smoothed' = the written-out loss with label smoothing 0.1, NAME with "
                    "'_smoothed'; 'shift' = Hugging Face's older loss on the shifted logits "
                    "written out (per-token losses, the kept ones' mean), NAME with '_shift'; "
                    "'items' = the model's own loss given num_items_in_batch, NAME with "
                    "'_items'")
    ap.add_argument("--lora", action="store_true",
                    help="peft LoRA r 8 on the attention's query / value projections, every "
                    "base parameter (the LM head too) frozen, NAME with '_lora'")
    ap.add_argument("--attn", choices=["eager", "sdpa"], default="eager",
                    help="transformers' attention implementation: 'eager' (explicit softmax) "
                    "or 'sdpa' (torch's scaled_dot_product_attention, transformers' default; "
                    "torch-joint exports it under SDPBackend.MATH: torch 2.13's exporter has no "
                    "decomposition of the CPU flash kernel's backward), NAME with '_sdpa'")
    ap.add_argument("--artifacts", action="store_true",
                    help="ortt: keep the checkpoint and the optimizer model (NAME.artifacts/)")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = _config(a.arch, a.seq, a.layers, a.attn)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        targets = ["c_attn"] if a.arch == "gpt2" else ["q_proj", "v_proj"]
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                 init_lora_weights=False))
        model = model.base_model.model.train()
    ids = torch.randint(0, VOCAB[a.arch], (1, a.seq))
    a.out.mkdir(parents=True, exist_ok=True)
    if {"own": "ortt", "reducemean": "torch", "smoothed": "torch", "shift": "torch",
            "items": "torch"}.get(a.loss, a.family) != a.family:
        ap.error(f"--loss {a.loss} is not a {a.family} spelling here")
    tag = {"own": "_ownloss", "reducemean": "_reducemean", "smoothed": "_smoothed",
           "shift": "_shift", "items": "_items"}.get(a.loss, "") + ("_lora" if a.lora else "")
    name = f"{a.family}_{a.arch}{tag}{'_sdpa' if a.attn == 'sdpa' else ''}_long_S{a.seq}"
    if a.family == "ortt":
        _ortt(model, ids, name, a.out, a.artifacts, a.loss == "own")
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):  # (eager attention calls no sdpa)
            _torch(model, ids, name, a.out, a.loss)
    print(a.out / f"{name}.onnx")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
