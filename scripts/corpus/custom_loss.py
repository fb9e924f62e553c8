"""The corpus's custom onnxblock loss (Arch.loss "custom"), written as a user writes one for
onnxruntime.training.artifacts.generate_artifacts(..., loss=TokenCrossEntropyWithLogitPenalty()):
an onnxblock.Block subclass composed of onnxblock's building blocks.

loss = CrossEntropy(logits [N, C], labels [N], ignore_index -100, mean over the kept rows)
       + mean(penalty * logits^2)
(a logit-size penalty against over-confident logits, in the spirit of z-loss). The logits are
read twice, by SoftmaxCrossEntropyLoss and by the penalty's Pow.

Imported by gen.py in the ort-training generator venv only (onnxruntime.training is not in the
torch-joint one); gen.py's torch reference for "custom" computes the same expression.
"""
from __future__ import annotations

from onnxruntime.training import onnxblock


class TokenCrossEntropyWithLogitPenalty(onnxblock.Block):
    def __init__(self, penalty: float, ignore_index: int = -100) -> None:
        super().__init__()
        self.cross_entropy = onnxblock.loss.CrossEntropyLoss(ignore_index=ignore_index)
        self.square = onnxblock.blocks.Pow(2.0)
        self.mean = onnxblock.blocks.ReduceMean(keepdims=False)
        self.penalty = onnxblock.blocks.Constant(penalty)
        self.scale = onnxblock.blocks.Mul()
        self.add = onnxblock.blocks.Add()

    def build(self, logits: str, labels: str = "labels") -> str:
        ce = self.cross_entropy(logits, labels)
        # the [1] constant scales before the mean: the sum of two rank-0 terms stays rank 0
        return self.add(ce, self.mean(self.scale(self.square(logits), self.penalty())))
