"""Triton kernels for kvlab, installed as `kvlab.kernels` (never as a top-level `kernels`).

Each kernel will sit beside a pure-torch reference with the same signature; the torch
reference path in `kvlab.attention` is what runs today on every device.
"""
