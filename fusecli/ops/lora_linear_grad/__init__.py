"""The fused op LoraLinearGrad: contract, NumPy reference, kernels and tests."""
