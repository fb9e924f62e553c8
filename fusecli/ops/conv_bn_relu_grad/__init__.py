"""The fused op ConvBnReluGrad: contract, NumPy reference, kernels and tests."""
