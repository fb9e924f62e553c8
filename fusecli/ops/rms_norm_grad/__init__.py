"""The fused op RMSNormGrad: contract, NumPy reference, kernels and tests."""
