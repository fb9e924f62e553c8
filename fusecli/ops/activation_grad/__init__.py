"""The fused op ActivationGrad: contract, NumPy reference, kernels and tests."""
