"""C++/CUDA sources of FlashOverlap's kernels, shipped as package data for the JIT build."""
