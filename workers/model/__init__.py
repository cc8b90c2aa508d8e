"""The decoder model: layers, fused kernels, attention backends (torch on CPU, Triton on GPU)."""
