"""Fused ops against their unfused chains at the shapes of real models, and on outlier inputs.

Each case builds one fused node and the onnxruntime-training chain it replaces (the com.microsoft
gradient ops the ort-training samples contain: ReluGrad / GeluGrad / QuickGeluGrad + ReduceSum +
Gemm; LayerNormalizationGrad; FusedMatMul + SoftmaxGrad_13; ReluGrad + BatchNormalizationGrad +
ConvGrad), fed with the same random tensors. Both are run once and compared (the row reports the
largest difference relative to the largest output) before they are timed side by side.

Shapes: ResNet-50's four stages at 64x64 input, batch 8 (each stage's 3x3 conv and its 1x1
reduce conv, and the stride-2 3x3 conv of the first block of layer2/3/4; the stride-2 1x1
downsample conv is followed by BatchNorm without ReLU: a conv_bn, not timed here); a MobileNetV2 block at 112x112, batch 8 (1x1 expand + ReLU6, 3x3 depthwise + ReLU6, 1x1 projection without activation, a stride-2 depthwise); a BERT-base layer (d=768, 12 heads of 64, FF 3072, seq 128, batch 8); a Llama-style
layer at TinyLlama-1.1B's sizes (d=2048, 32 heads of 64, FF 5632 with SiLU, seq 256, batch 1).

Outlier inputs (``outliers=True``): pre-activations uniform in [-40, 40] (the exp/erf tails of
the activation gradients underflow far below the smallest normal float), attention
probabilities from logits uniform in [-40, 40], LayerNorm / BatchNorm rows and channels with
values up to ~40 and some with variances far below epsilon.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fusecli.ops.contracts import FUSED_DOMAIN

MS = "com.microsoft"
F = TensorProto.FLOAT


@dataclass
class Case:
    model: str  # "ResNet-50 layer3", "BERT-base", ...
    op: str
    label: str  # op label with activation
    shape: str
    unfused: onnx.ModelProto
    fused: onnx.ModelProto
    feeds: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)


def _model(nodes, feeds, outputs, inits=()):
    ins = [helper.make_tensor_value_info(k, F, list(v.shape)) for k, v in feeds.items()]
    outs = [helper.make_tensor_value_info(o, F, None) for o in outputs]
    g = helper.make_graph(nodes, "case", ins, outs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1),
                                            helper.make_opsetid(FUSED_DOMAIN, 1)])
    m.ir_version = 8
    return m


def _f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def _big(rng, shape):
    """Values uniform in [-40, 40] with the underflow band's edges and zero included."""
    x = rng.uniform(-40.0, 40.0, shape)
    edges = [0.0, -9.3, 9.3, -13.2, 13.2, -14.0, 14.0, -40.0, 40.0]
    x.reshape(-1)[: len(edges)] = edges
    return x


def linear_case(model, act, m, n, k, rng, outliers=False) -> Case:
    """LinearActivationGrad (dA, dW, dB) vs act grad + ReduceSum + Gemm (dW) + Gemm (dA)."""
    feeds = {"dY": _f32(rng.standard_normal((m, n))),
             "X": _f32(_big(rng, (m, n)) if outliers else rng.standard_normal((m, n))),
             "A": _f32(rng.standard_normal((m, k))),
             "W": _f32(rng.standard_normal((n, k)) / np.sqrt(k))}
    if act == "relu":  # ReluGrad tests the saved output, which has the pre-activation's sign
        grad = helper.make_node("ReluGrad", ["dY", "X"], ["dZ"], domain=MS)
    elif act == "gelu":
        grad = helper.make_node("GeluGrad", ["dY", "X"], ["dZ"], domain=MS)
    else:
        grad = helper.make_node("QuickGeluGrad", ["dY", "X"], ["dZ"], domain=MS, alpha=1.0)
    axes = helper.make_tensor("axes0", TensorProto.INT64, [1], [0])
    chain = [grad,
             helper.make_node("ReduceSum", ["dZ", "axes0"], ["dB"], keepdims=0),
             helper.make_node("Gemm", ["dZ", "A"], ["dW"], transA=1),
             helper.make_node("Gemm", ["dZ", "W"], ["dA"])]
    fused = helper.make_node("LinearActivationGrad", ["dY", "X", "A", "W"],
                             ["dA", "dW", "dB", "dZ_ws"], domain=FUSED_DOMAIN, activation=act,
                             trans_w=0)
    outs = ["dA", "dW", "dB"]
    return Case(model, "LinearActivationGrad", f"LinearActivationGrad {act}",
                f"M={m} N={n} K={k}", _model(chain, feeds, outs, [axes]),
                _model([fused], feeds, outs), feeds, outs)


def lora_case(model, m, n, k, r, rng, scale=2.0) -> Case:
    """LoraLinearGrad (dX, dLa, dLb; identity, as peft's q_proj/v_proj) vs the ort-training chain
    of a LoRA-wrapped frozen Linear: Mul (scale) + FusedMatMul x3 (lora_B's and lora_A's input
    gradients, the base's) + Sum + Gemm/Transpose x2 (the adapters' weight gradients)."""
    xd = rng.standard_normal((m, k))
    la = rng.standard_normal((r, k)) / np.sqrt(k)
    feeds = {"dY": _f32(rng.standard_normal((m, n))), "A": _f32(xd),
             "Wt": _f32(rng.standard_normal((k, n)) / np.sqrt(k)),
             "LaT": _f32(la.T), "LbT": _f32(rng.standard_normal((r, n)) / np.sqrt(r)),
             "La": _f32(la), "H": _f32(xd @ la.T)}
    feeds["Lb"] = _f32(feeds["LbT"].T)
    s = helper.make_tensor("s", F, [], [scale])
    mm = dict(domain=MS, transB=1)
    chain = [helper.make_node("Mul", ["dY", "s"], ["dU"]),
             helper.make_node("FusedMatMul", ["dU", "LbT"], ["dH"], **mm),
             helper.make_node("FusedMatMul", ["dH", "LaT"], ["dXa"], **mm),
             helper.make_node("FusedMatMul", ["dY", "Wt"], ["dXb"], **mm),
             helper.make_node("Sum", ["dXa", "dXb"], ["dX"]),
             helper.make_node("Gemm", ["H", "dU"], ["dLbT"], transA=1),
             helper.make_node("Transpose", ["dLbT"], ["dLb"], perm=[1, 0]),
             helper.make_node("Gemm", ["A", "dH"], ["dLaT"], transA=1),
             helper.make_node("Transpose", ["dLaT"], ["dLa"], perm=[1, 0])]
    fused = helper.make_node("LoraLinearGrad", ["dY", "", "A", "Wt", "La", "Lb", "H"],
                             ["dX", "", "dLa", "dLb", "", "", "dZ_ws"], domain=FUSED_DOMAIN,
                             activation="identity", scale=scale, trans_w=1)
    outs = ["dX", "dLa", "dLb"]
    return Case(model, "LoraLinearGrad", "LoraLinearGrad identity", f"M={m} N={n} K={k} r={r}",
                _model(chain, feeds, outs, [s]), _model([fused], feeds, outs), feeds, outs)


def layernorm_case(model, m, n, rng, outliers=False) -> Case:
    """LayerNormGrad vs LayerNormalizationGrad (dX, dGamma, dBeta), one row per token."""
    x = rng.standard_normal((m, n))
    if outliers:
        x = _big(rng, (m, n))
        x[: m // 4] = 1.5 + 1e-6 * rng.standard_normal((m // 4, n))  # variance << eps
    x = _f32(x)
    x64 = x.astype(np.float64)
    feeds = {"dY": _f32(rng.standard_normal((m, n))), "X": x,
             "gamma": _f32(1.0 + 0.1 * rng.standard_normal(n)),
             "mean": _f32(x64.mean(1, keepdims=True)),
             "inv_std": _f32(1.0 / np.sqrt(x64.var(1, keepdims=True) + 1e-5))}
    chain = [helper.make_node("LayerNormalizationGrad", ["dY", "X", "gamma", "mean", "inv_std"],
                              ["dX", "dGamma", "dBeta"], domain=MS, axis=-1, epsilon=1e-5)]
    fused = helper.make_node("LayerNormGrad", ["dY", "X", "gamma", "mean", "inv_std"],
                             ["dX", "dGamma", "dBeta"], domain=FUSED_DOMAIN, axis=-1)
    outs = ["dX", "dGamma", "dBeta"]
    return Case(model, "LayerNormGrad", "LayerNormGrad", f"[{m}, {n}]",
                _model(chain, feeds, outs), _model([fused], feeds, outs), feeds, outs)


def attention_case(model, bh, s, d, rng, outliers=False) -> Case:
    """AttentionGrad vs FusedMatMul (dV, dP) + SoftmaxGrad_13 + Mul (scale) + FusedMatMul (dQ,
    dK); P = softmax of random logits (|logit| up to 40 with outliers)."""
    scale = 1.0 / np.sqrt(d)
    logits = _big(rng, (bh, s, s)) if outliers else rng.standard_normal((bh, s, s)) * 2.0
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    feeds = {"dO": _f32(rng.standard_normal((bh, s, d))), "Q": _f32(rng.standard_normal((bh, s, d))),
             "K": _f32(rng.standard_normal((bh, s, d))), "V": _f32(rng.standard_normal((bh, s, d))),
             "P": _f32(p)}
    sc = helper.make_tensor("scale", F, [], [scale])
    chain = [helper.make_node("FusedMatMul", ["P", "dO"], ["dV"], domain=MS, transA=1),
             helper.make_node("FusedMatMul", ["dO", "V"], ["dP"], domain=MS, transB=1),
             helper.make_node("SoftmaxGrad_13", ["dP", "P"], ["dS"], domain=MS, axis=-1),
             helper.make_node("Mul", ["dS", "scale"], ["dSs"]),
             helper.make_node("FusedMatMul", ["dSs", "K"], ["dQ"], domain=MS),
             helper.make_node("FusedMatMul", ["dSs", "Q"], ["dK"], domain=MS, transA=1)]
    fused = helper.make_node("AttentionGrad", ["dO", "Q", "K", "V", "P"], ["dQ", "dK", "dV"],
                             domain=FUSED_DOMAIN, scale_q=float(scale), scale_k=float(scale),
                             k_transposed=0)
    outs = ["dQ", "dK", "dV"]
    return Case(model, "AttentionGrad", "AttentionGrad", f"BH={bh} Sq={s} Sk={s} D={d}",
                _model(chain, feeds, outs, [sc]), _model([fused], feeds, outs), feeds, outs)


def conv_case(model, n, cin, c, hw, k, rng, outliers=False, stride=1, group=1,
              act="relu") -> Case:
    """ConvBnReluGrad vs activation gradient + BatchNormalizationGrad + ConvGrad (pads k // 2:
    'same' at stride 1; at stride s the input is s*hw square and the output hw square, as in
    ResNet's downsampling convs). act: relu (ReluGrad), relu6 (onnxruntime-training's Clip
    gradient mask on the BN output), silu (QuickGeluGrad), hardswish (written out as
    z relu6(z + 3) / 6: its product rule with the Clip mask), identity (none: a linear
    bottleneck)."""
    p = k // 2
    hin = hw * stride
    cv = rng.standard_normal((n, c, hw, hw))
    if outliers:
        cv = _big(rng, (n, c, hw, hw))
        cv[:, : c // 4] = 0.7 + 1e-6 * rng.standard_normal((n, c // 4, hw, hw))  # var << eps
    mean = cv.mean(axis=(0, 2, 3))
    inv_std = 1.0 / np.sqrt(cv.var(axis=(0, 2, 3)) + 1e-5)
    xhat = (cv - mean[None, :, None, None]) * inv_std[None, :, None, None]
    # relu: the ReLU output; else the BN output (gamma 1, beta 1: ReLU6's mask cuts both sides)
    y = np.maximum(xhat, 0) if act == "relu" else 3.0 * xhat + 1.0
    feeds = {"dY": _f32(rng.standard_normal((n, c, hw, hw))), "Y": _f32(y),
             "X": _f32(_big(rng, (n, cin, hin, hin)) if outliers
                       else rng.standard_normal((n, cin, hin, hin))),
             "W": _f32(rng.standard_normal((c, cin // group, k, k)) / np.sqrt(cin // group * k * k)),
             "Cv": _f32(cv), "gamma": _f32(np.ones(c)), "mean": _f32(mean),
             "inv_std": _f32(inv_std)}
    attrs = dict(strides=[stride, stride], pads=[p] * 4, dilations=[1, 1], group=group)
    fused_ins = list(feeds)
    consts = []
    if act == "relu":
        grad = [helper.make_node("ReluGrad", ["dY", "Y"], ["dZ"], domain=MS)]
    elif act in ("relu6", "hardswish"):
        consts = [numpy_helper.from_array(np.array(0, np.float32), "c0"),
                  numpy_helper.from_array(np.array(6, np.float32), "c6")]
        # onnxruntime-training's Clip gradient: dY masked where the Clip input is in [0, 6]
        # (relu6: the BN output; hardswish written out, z relu6(z + 3) / 6: z + 3)
        z = "Y" if act == "relu6" else "A"
        grad = [helper.make_node("GreaterOrEqual", [z, "c0"], ["ge"]),
                helper.make_node("LessOrEqual", [z, "c6"], ["le"]),
                helper.make_node("And", ["ge", "le"], ["m"]),
                helper.make_node("Cast", ["m"], ["mf"], to=1)]
        if act == "relu6":
            grad.append(helper.make_node("Mul", ["dY", "mf"], ["dZ"]))
        else:  # the product rule of z * relu6(z + 3) / 6, A = z + 3 and Cl = relu6(A) saved
            feeds["A"] = _f32(feeds["Y"] + np.float32(3))
            feeds["Cl"] = _f32(np.clip(feeds["A"], 0, 6))
            grad = [helper.make_node("Div", ["dY", "c6"], ["dM"]),
                    helper.make_node("Mul", ["dM", "Cl"], ["dZ1"]),
                    helper.make_node("Mul", ["dM", "Y"], ["dCl"]), *grad,
                    helper.make_node("Mul", ["dCl", "mf"], ["dA"]),
                    helper.make_node("Sum", ["dA", "dZ1"], ["dZ"])]
    elif act == "silu":  # onnxruntime-training's SiLU gradient (QuickGelu{alpha=1})
        grad = [helper.make_node("QuickGeluGrad", ["dY", "Y"], ["dZ"], domain=MS, alpha=1.0)]
    else:  # no activation: BatchNormalizationGrad reads dY
        grad = []
    chain = [*grad,
             helper.make_node("BatchNormalizationGrad",
                              ["dZ" if grad else "dY", "Cv", "gamma", "mean", "inv_std"],
                              ["dC", "dGamma", "dBeta"], domain=MS, epsilon=1e-5),
             helper.make_node("ConvGrad", ["dC", "X", "W"], ["dX", "dW"], domain=MS,
                              kernel_shape=[k, k], **attrs)]
    fused = helper.make_node("ConvBnReluGrad", fused_ins, ["dX", "dW", "", "dGamma", "dBeta",
                                                           "dC_ws"],
                             domain=FUSED_DOMAIN, activation=act, **attrs)
    if act == "identity":
        fused.input[1] = ""
    outs = ["dX", "dW", "dGamma", "dBeta"]
    return Case(model, "ConvBnReluGrad", "ConvBnReluGrad",
                f"N={n} C={c} Cin={cin} {hw}x{hw} k={k}x{k}"
                + (f" stride {stride} (input {hin}x{hin})" if stride != 1 else "")
                + (" depthwise" if group == c and group > 1 else
                   f" group {group}" if group > 1 else "")
                + ("" if act == "relu" else f" {act}"),
                _model(chain, feeds, outs, consts),
                _model([fused], feeds, outs), feeds, outs)


def gated_case(model, act, m, ff, rng) -> Case:
    """GatedActivationGrad (dA, dB) vs onnxruntime-training's backward of act(A) * B: Mul (dS =
    dH B), Mul (dB = dH S, S = act(A) saved by the forward), QuickGeluGrad{alpha=1} (silu) or
    GeluGrad (gelu) (dS, A) -> dA."""
    a = rng.standard_normal((m, ff))
    if act == "silu":
        s = a / (1.0 + np.exp(-a))
        grad = helper.make_node("QuickGeluGrad", ["dS", "A"], ["dA"], domain=MS, alpha=1.0)
    else:
        from math import erf
        s = a * 0.5 * (1.0 + np.vectorize(erf)(a / np.sqrt(2.0)))
        grad = helper.make_node("GeluGrad", ["dS", "A"], ["dA"], domain=MS)
    feeds = {"dH": _f32(rng.standard_normal((m, ff))), "A": _f32(a),
             "B": _f32(rng.standard_normal((m, ff))), "S": _f32(s)}
    chain = [helper.make_node("Mul", ["dH", "B"], ["dS"]),
             helper.make_node("Mul", ["dH", "S"], ["dB"]), grad]
    fused = helper.make_node("GatedActivationGrad", ["dH", "A", "B"], ["dA", "dB"],
                             domain=FUSED_DOMAIN, activation=act)
    outs = ["dA", "dB"]
    name = {"silu": "swiglu", "gelu": "geglu"}[act]
    return Case(model, "GatedActivationGrad", f"GatedActivationGrad {act} ({name})",
                f"[{m}, {ff}]", _model(chain, feeds, outs), _model([fused], feeds, outs), feeds,
                outs)


def rope_case(model, b, heads, seq, hd, rng) -> Case:
    """RotaryEmbeddingGrad (rotate-half) vs onnxruntime-training's backward of X cos +
    rotate_half(X) sin on one tensor [b, heads, seq, hd] (cos / sin [b, 1, seq, hd]): Mul (dY
    sin), SplitTraining into halves, Neg, Concat, Mul (dY cos), Sum."""
    pos = np.arange(seq)[:, None] / 10000.0 ** (np.arange(0, hd, 2) / hd)[None, :]
    ang = np.concatenate([pos, pos], axis=-1)[None, None].repeat(b, 0)
    feeds = {"dY": _f32(rng.standard_normal((b, heads, seq, hd))), "cos": _f32(np.cos(ang)),
             "sin": _f32(np.sin(ang))}
    lens = numpy_helper.from_array(np.array([hd // 2, hd // 2], np.int64), "lens")
    chain = [helper.make_node("Mul", ["dY", "sin"], ["g"]),
             helper.make_node("SplitTraining", ["g", "lens"], ["g_neg", "g1"], domain=MS,
                              axis=-1),
             helper.make_node("Neg", ["g_neg"], ["g2"]),
             helper.make_node("Concat", ["g1", "g2"], ["rt"], axis=-1),
             helper.make_node("Mul", ["dY", "cos"], ["dc"]),
             helper.make_node("Sum", ["rt", "dc"], ["dX"])]
    fused = helper.make_node("RotaryEmbeddingGrad", ["dY", "cos", "sin"], ["dX"],
                             domain=FUSED_DOMAIN, interleaved=0, axis=-1)
    return Case(model, "RotaryEmbeddingGrad", "RotaryEmbeddingGrad rotate-half",
                f"[{b}, {heads}, {seq}, {hd}]", _model(chain, feeds, ["dX"], [lens]),
                _model([fused], feeds, ["dX"]), feeds, ["dX"])


# ResNet-50 at 64x64, batch 8: per stage (maps, width, bottleneck input channels)
RESNET50_STAGES = [(1, 16, 64, 256), (2, 8, 128, 512), (3, 4, 256, 1024), (4, 2, 512, 2048)]
BERT_BASE = dict(d=768, heads=12, head_dim=64, ff=3072, seq=128, batch=8)
LLAMA_STYLE = dict(d=2048, heads=32, head_dim=64, ff=5632, seq=256, batch=1)  # TinyLlama-1.1B


def real_shape_cases(seed: int = 0) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases = []
    for stage, hw, width, cin in RESNET50_STAGES:
        name = f"ResNet-50 layer{stage} (64x64, batch 8)"
        cases.append(conv_case(name, 8, width, width, hw, 3, rng))
        cases.append(conv_case(name, 8, cin, width, hw, 1, rng))
        if stage > 1:  # the stage's first block: its 3x3 conv halves the map (torchvision v1.5)
            cases.append(conv_case(name, 8, width, width, hw, 3, rng, stride=2))
    # MobileNetV2 (torchvision, width 1.0) at 112x112, batch 8: an inverted-residual block of
    # the 24-channel stage (1x1 expand to 144 + ReLU6, 3x3 depthwise + ReLU6, 1x1 projection
    # without activation) and the next block's stride-2 depthwise conv
    name = "MobileNetV2 block (112x112, batch 8)"
    cases.append(conv_case(name, 8, 24, 144, 28, 1, rng, act="relu6"))
    cases.append(conv_case(name, 8, 144, 144, 28, 3, rng, group=144, act="relu6"))
    cases.append(conv_case(name, 8, 144, 24, 28, 1, rng, act="identity"))
    cases.append(conv_case(name, 8, 144, 144, 14, 3, rng, stride=2, group=144, act="relu6"))
    for name, cfg, act in (("BERT-base (seq 128, batch 8)", BERT_BASE, "gelu"),
                           ("Llama-style, TinyLlama-1.1B sizes (seq 256, batch 1)", LLAMA_STYLE,
                            "silu")):
        m = cfg["seq"] * cfg["batch"]
        cases.append(linear_case(name, act, m, cfg["ff"], cfg["d"], rng))
        cases.append(layernorm_case(name, m, cfg["d"], rng))
        cases.append(attention_case(name, cfg["batch"] * cfg["heads"], cfg["seq"],
                                    cfg["head_dim"], rng))
        # a LoRA (r=16) on its q_proj, base frozen (peft's default targets)
        cases.append(lora_case(name, m, cfg["d"], cfg["d"], 16, rng))
    return cases


def model_op_cases(seed: int = 2) -> list[Case]:
    """Section (h): the ops of the gated-MLP / RoPE / mobile-CNN patterns at the shapes of its
    step samples (MobileNetV2 on 64x64, batch 8; the Llama of scripts/corpus/archs.py
    BENCH_LLAMA) and at TinyLlama-1.1B's, ConvBnReluGrad with each activation."""
    rng = np.random.default_rng(seed)
    name = "MobileNetV2 (64x64, batch 8)"
    cases = [conv_case(name, 8, 16, 96, 32, 1, rng, act="relu6"),             # expand
             conv_case(name, 8, 144, 144, 16, 3, rng, group=144, act="relu6"),  # depthwise
             conv_case(name, 8, 96, 96, 16, 3, rng, stride=2, group=96, act="relu6"),
             conv_case(name, 8, 576, 576, 2, 3, rng, stride=2, group=576, act="relu6"),
             conv_case(name, 8, 144, 24, 16, 1, rng, act="identity"),         # projection
             conv_case(name, 8, 960, 960, 2, 3, rng, group=960, act="relu6")]
    # the same block shapes with the activations of EfficientNet (SiLU), MobileNetV3
    # (Hardswish) and ResNet-style blocks (ReLU)
    for act, model in (("silu", "EfficientNet-style block (64x64, batch 8)"),
                       ("hardswish", "MobileNetV3-style block (64x64, batch 8)"),
                       ("relu", "ReLU block (64x64, batch 8)")):
        cases.append(conv_case(model, 8, 16, 96, 32, 1, rng, act=act))
        cases.append(conv_case(model, 8, 144, 144, 16, 3, rng, group=144, act=act))
    for model, d, heads, kv, ff, seq in (
            ("Llama (bench sample: d=512, seq 256, batch 1)", 512, 8, 4, 1408, 256),
            ("TinyLlama-1.1B sizes (seq 256, batch 1)", LLAMA_STYLE["d"], LLAMA_STYLE["heads"],
             4, LLAMA_STYLE["ff"], LLAMA_STYLE["seq"])):
        cases.append(gated_case(model, "silu", seq, ff, rng))
        cases.append(gated_case(model, "gelu", seq, ff, rng))
        cases.append(rope_case(model, 1, heads, seq, d // heads, rng))  # Q
        cases.append(rope_case(model, 1, kv, seq, d // heads, rng))     # K
    return cases


def outlier_cases(seed: int = 1) -> list[Case]:
    """Every fused op on outlier inputs, at BERT-base shapes (conv: ResNet-50 layer3)."""
    rng = np.random.default_rng(seed)
    b = BERT_BASE
    m = b["seq"] * b["batch"]
    name = "BERT-base shapes, |x| up to 40"
    cases = [linear_case(name, act, m, b["ff"], b["d"], rng, outliers=True)
             for act in ("relu", "gelu", "silu")]
    cases.append(layernorm_case(name, m, b["d"], rng, outliers=True))
    cases.append(attention_case(name, b["batch"] * b["heads"], b["seq"], b["head_dim"], rng,
                                outliers=True))
    cases.append(conv_case("ResNet-50 layer3 shapes, |x| up to 40", 8, 256, 256, 4, 3, rng,
                           outliers=True))
    return cases
