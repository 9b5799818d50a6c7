"""The CUDA sources of the cupy_fusion technique, installed as ``workbench.kernels``.

Python code that compiles and launches them lives in workbench/raw_kernels.py and
workbench/fused_ops.py; this package only carries the .cu files and their shared header.
"""
