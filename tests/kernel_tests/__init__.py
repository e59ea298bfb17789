"""Kernel-level tests: each kernel family, its Triton and CPU paths, against its torch reference."""
