"""The fused op AttentionGrad: contract, NumPy reference, kernels and tests."""
