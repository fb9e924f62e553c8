"""The fused op LayerNormGrad: contract, NumPy reference, kernels and tests."""
