"""Triton kernels with their launchers and torch references."""
