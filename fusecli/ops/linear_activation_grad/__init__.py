"""The fused op LinearActivationGrad: contract, NumPy reference, kernels and tests."""
