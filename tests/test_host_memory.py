"""A CPU engine's host memory: freed buffers are reused, not faulted in anew
(kvlab.model.host_memory)."""

import multiprocessing
import resource

import pytest
import torch

from kvlab.model.host_memory import keep_freed_memory

ROWS = 3_000  # a prompt step's tokens
PAGE = resource.getpagesize()


def _faults_of_one_step(layers: int = 4) -> tuple[int, int]:
    """Minor page faults while buffers of a prompt step's sizes (fp32, SmolLM2-135M's
    widths) are made, written and freed layer after layer; and the bytes they hold."""
    before, made = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, 0
    h = torch.ones(ROWS, 576)
    for _ in range(layers):
        normed = h * 2
        qkv = torch.ones(ROWS, 960)
        gate_up = torch.ones(ROWS, 3072)  # 37 MB: above glibc's largest mmap threshold
        act = gate_up[:, :1536] * gate_up[:, 1536:]
        h = act[:, :576] + normed
        made += sum(x.numel() * 4 for x in (normed, qkv, gate_up, act, h))
        del normed, qkv, gate_up, act
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, made


def _steady_faults() -> tuple[list[int], int] | None:
    """With freed memory kept: two steps to grow the heap, then each of three steps'
    faults, and the pages one step holds (None where the C library is not glibc)."""
    if not keep_freed_memory():
        return None
    for _ in range(2):
        _faults_of_one_step()  # the heap grows to hold a step
    steps = [_faults_of_one_step() for _ in range(3)]
    return [f for f, _ in steps], steps[0][1] // PAGE


def test_a_step_reuses_the_pages_the_steps_before_it_faulted_in():
    # in a fresh process: a test worker's heap, shaped by every test before this one, can
    # split a freed buffer for small objects and grow anew (CI saw 10,102 faults once)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        steady = pool.apply(_steady_faults)
    if steady is None:
        pytest.skip("the C library is not glibc: its malloc is left as it is")
    faults, fresh = max(steady[0]), steady[1]  # fresh: what a step faults with every page new
    assert faults < fresh // 10, f"{faults} faults of {fresh} pages: freed pages went back"


def test_it_is_set_once_per_process():
    assert keep_freed_memory() is keep_freed_memory()
    assert keep_freed_memory.cache_info().currsize == 1


def test_a_cpu_runner_keeps_freed_memory(model):
    """Every CPU model runner sets it (tensor-parallel ranks and prefill workers too)."""
    from kvlab.model.runner import ModelRunner

    keep_freed_memory.cache_clear()
    ModelRunner(model.hf_model)
    assert keep_freed_memory.cache_info().currsize == 1
