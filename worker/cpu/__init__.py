"""The CPU fast path: C kernels (`csrc/`, built and loaded by `kernels`), the one call per op
that model code makes into them (`ops`), linear layers on packed weights (`linear`) and the
one-call decode step (`fused_decode`). Everything here falls back to PyTorch ops where a
kernel does not apply, with the same results."""
