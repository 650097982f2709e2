"""Triton kernels of the triton attention backend (``attention/triton_backend.py``).

``mode.py`` decides whether the backend can run here without importing triton; the kernel modules
import triton, and only the backend imports them, when it first runs, so the rest of gearshift
never needs triton.
"""
