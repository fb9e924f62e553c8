"""Generate corpus graphs with transformers' default attention: `gen_sdpa.py --out DIR FAMILY ARCH
[ARCH ...]`.

Every other corpus graph is built with attn_implementation="eager". This builds the named
transformers architectures with "sdpa" (torch.nn.functional.scaled_dot_product_attention, what
a user who does not set it exports), as `ARCH_sdpa`, each counted as flash attention
(Arch.flash: its attention calls are fusable, archs.FLASH_NOTE), then runs gen.py on them.
torch-joint exports under SDPBackend.MATH: torch 2.13's dynamo exporter has no decomposition of
the CPU flash kernel's backward (aten._scaled_dot_product_flash_attention_for_cpu_backward), so
the math backend is the one a torch-joint graph of sdpa attention can be exported with (gen.py
exports every torch-joint graph under it). ort-training (torch.onnx, TorchScript) writes sdpa
out itself.

Run with the corpus venvs (scripts/corpus/SWEEP.md, "Default-attention sweep"):
build/venv-corpus-torch/bin/python scripts/corpus/gen_sdpa.py --out build/sdpa torch-joint llama_lm
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import archs  # noqa: E402
import gen  # noqa: E402


def _sdpa(build):
    def make(family):
        net = build(family)
        net.net.config._attn_implementation = "sdpa"
        return net
    return make


def main(argv: list[str]) -> int:
    if argv[:1] != ["--out"] or len(argv) < 4:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    out, family, names = argv[1], argv[2], argv[3:]
    for n in names:
        a = archs.ARCHS[n]
        archs.ARCHS[f"{n}_sdpa"] = dataclasses.replace(a, name=f"{n}_sdpa", build=_sdpa(a.build),
                                                      flash=True)
    return gen.main(["--out", out, family, *[f"{n}_sdpa" for n in names]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
