"""Batch-invariant mode (EngineConfig.batch_invariant): a request's logits, bit for bit,
whatever else runs: batch size, chunked prefill, prefix-cache hits, thread count, and
a decode step equals the same row in a prompt."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

import kvlab
from kvlab.cache.pool import KVPool
from kvlab.experiments.determinism import ALONE, Setting, compare_steps, matmul_rows, run
from kvlab.model.invariant import InvariantAttention, InvariantLinears, kernel_runs
from kvlab.model.invariant_attention import group_invariant, invariant_attention
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.runner import ModelRunner

CHUNKS_8 = {"chunked_prefill": True, "max_num_batched_tokens": 8}
WARM_CHUNKS_24 = {"prefix_caching": "hash", "chunked_prefill": True, "max_num_batched_tokens": 24}
SETTINGS = [  # each one differs from running alone in several ways at once
    Setting("batch of 16, 2 threads", threads=2, batch=16),
    Setting("batch of 4, chunks of 8, 1 thread", CHUNKS_8, threads=1, batch=4),
    Setting("warm prefix, chunks of 24, batch of 2", WARM_CHUNKS_24, warm=True, batch=2),
]


def prompts_of(model, count: int) -> list[list[int]]:
    """Chat-template token ids of the first `count` chat prompts (lengths 20-40)."""
    from kvlab import texts
    from kvlab.model.prompts import encode_prompt

    return [encode_prompt(model.tokenizer, p) for p in texts.chat_prompts()[:count]]


def differing(reference, answers) -> int:
    """Steps, over all prompts, whose logits are not the reference's bits."""
    frame = compare_steps(reference, answers)
    return int((frame["steps"] - frame["bit_exact"]).sum())


def assert_same_bits_in_every_setting(model, attention: str) -> None:
    """Each of SETTINGS gives the reference's bits at every step of every prompt."""
    prompts, companions = prompts_of(model, 16)[:4], prompts_of(model, 16)[4:]
    base = {"attention": attention, "block_size": 8, "batch_invariant": True}
    reference = run(model, prompts, ALONE, new_tokens=6, base=base)
    for setting in SETTINGS:
        answers = run(model, prompts, setting, 6, base, companions)
        assert differing(reference, answers) == 0, setting.name


@pytest.mark.parametrize("attention", ["torch", "kernels"])
def test_tiny_model_logits_are_the_same_bits_in_every_setting(tiny_model, attention):
    assert_same_bits_in_every_setting(tiny_model, attention)


@pytest.mark.parametrize("attention", ["torch", "kernels"])
def test_bf16_logits_are_the_same_bits_in_every_setting(tiny_model_path, attention):
    """bf16 weights and K/V: the same guarantee (each product summed in fp32 in the fixed
    order, rounded to bf16 once, as the default path rounds)."""
    model = kvlab.load_model(tiny_model_path, device="cpu", dtype=torch.bfloat16, progress=False)
    assert_same_bits_in_every_setting(model, attention)


def test_without_it_the_same_settings_change_bits(tiny_model):
    """The comparison above can fail: in the default mode the settings change logits."""
    prompts, companions = prompts_of(tiny_model, 16)[:4], prompts_of(tiny_model, 16)[4:]
    base = {"block_size": 8}
    reference = run(tiny_model, prompts, ALONE, new_tokens=6, base=base)
    changed = [
        differing(reference, run(tiny_model, prompts, s, 6, base, companions)) for s in SETTINGS
    ]
    assert all(changed), changed


@pytest.mark.parametrize("attention", ["torch", "kernels"])
def test_real_model_logits_are_the_same_bits_batched_chunked_warm_on_one_thread(model, attention):
    prompts = prompts_of(model, 4)
    base = {"attention": attention, "batch_invariant": True}
    reference = run(model, prompts[:1], Setting("2 threads", threads=2), new_tokens=4, base=base)
    mixed = Setting(
        "batch of 4, chunks of 16, warm prefix, 1 thread",
        {"chunked_prefill": True, "max_num_batched_tokens": 16, "prefix_caching": "hash"},
        threads=1,
        batch=4,
        warm=True,
    )
    assert differing(reference, run(model, prompts, mixed, new_tokens=4, base=base)[:1]) == 0


def test_greedy_answers_in_a_batch_equal_hf_generate_alone(model, chat_prompts):
    engine = kvlab.Engine(
        model,
        kvlab.EngineConfig(
            cache="paged", max_model_len=512, batch_invariant=True, attention="kernels"
        ),
    )
    outputs = engine.generate(chat_prompts[:3], kvlab.SamplingParams(max_new_tokens=16))
    for out in outputs:
        expected = hf_greedy(model, out.prompt_token_ids, 16)
        assert out.token_ids == expected[: len(out.token_ids)]
    assert outputs[0].text == "The capital of France is Paris."


@pytest.mark.parametrize("kernels", [False, True])
def test_a_decode_step_equals_the_same_row_in_a_prompt(tiny_model, kernels):
    runner = ModelRunner(tiny_model.hf_model, InvariantAttention(kernels), batch_invariant=True)
    ids = list(range(100, 170))
    pool = KVPool(runner.kv_spec, 80, runner.dtype, runner.device)
    meta = build_attention_metadata([0], [len(ids)], [[0]], 80, runner.device)
    prompt = runner.forward(torch.tensor(ids), meta, pool, all_logits=True)  # (70, vocab)
    pool = KVPool(runner.kv_spec, 80, runner.dtype, runner.device)
    for position, token in enumerate(ids):  # one token a step, as decoding does
        meta = build_attention_metadata([position], [1], [[0]], 80, runner.device)
        step = runner.forward(torch.tensor([token]), meta, pool)[0]
        assert torch.equal(step, prompt[position]), position


def test_invariant_attention_matches_the_reference(tiny_model, monkeypatch):
    """Same rows as pooled_attention up to rounding (it is attention, reordered), and the
    same bits when a prompt's rows go 7 at a time."""
    from kvlab.model import invariant_attention as module
    from kvlab.model.attention import pooled_attention

    runner = ModelRunner(tiny_model.hf_model)
    pool = KVPool(runner.kv_spec, 128, runner.dtype, runner.device)
    k = torch.randn(128, runner.num_kv_heads, runner.head_dim)
    pool.write(0, torch.arange(128), k, torch.randn_like(k))
    tables = [[0, 1], [2], [3, 4, 5]]
    meta = build_attention_metadata([0, 10, 40], [20, 1, 1], tables, 16, runner.device)
    q = torch.randn(22, runner.num_heads, runner.head_dim)
    ours = invariant_attention(q, 0, pool, meta, runner.scale)
    torch.testing.assert_close(ours, pooled_attention(q, 0, pool, meta, runner.scale))
    group = meta.groups[-1]  # the prompt's 20 rows
    monkeypatch.setattr(module, "QUERY_CHUNK", 7)
    assert torch.equal(
        ours[group.rows], group_invariant(q[group.rows], 0, pool, group, runner.scale)
    )


def test_kernels_path_runs_the_native_kernel_here(model):
    from kvlab.kernels import cpu_kernels_available

    assert kernel_runs(None, 64, torch.device("cpu")) == cpu_kernels_available()
    assert not kernel_runs("int8", 64, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linears_keep_a_rows_bits_in_any_batch_on_any_thread_count(dtype):
    """By construction, not by a library's habit on one CPU: row 0's bits alone equal its
    bits among 2-40 rows, on 1 and 2 threads; and the product is x @ weight.T."""
    weight = torch.randn(1536, 576).to(dtype)  # SmolLM2's gate projection's shape
    x = torch.randn(40, 576).to(dtype)
    linear = InvariantLinears()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = linear(x[:1], weight)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert all(torch.equal(linear(x[:m], weight)[:1], alone) for m in (2, 3, 17, 40))
    finally:
        torch.set_num_threads(before)
    exact = (x.double() @ weight.double().T).to(dtype)
    torch.testing.assert_close(linear(x, weight), exact, rtol=1e-2, atol=1e-2)
    table = matmul_rows(weight.float(), counts=(1, 2, 16))
    assert table[table["matmul"] == "kvlab invariant"]["same_bits"].all()


def test_invariant_kernels_keep_a_rows_bits_inside_a_longer_product():
    """Zero terms past a row's end add nothing: a softmax row over 40 keys gets the same
    bits inside 1,000 keys (the attention's value product), and e^-inf is 0."""
    from kvlab.kernels.cpu_invariant import invariant_bmm, invariant_exp

    weights = torch.rand(3, 1000)
    weights[:, 40:] = 0.0
    values = torch.randn(1, 65, 1000)
    long = invariant_bmm(weights[None], values)
    short = invariant_bmm(weights[None, :, :40].contiguous(), values[:, :, :40].contiguous())
    assert torch.equal(long, short)
    scores = torch.randn(37)
    scores[5] = float("-inf")
    exp = invariant_exp(scores)
    assert exp[5] == 0 and torch.equal(invariant_exp(scores[:9]), exp[:9])
    torch.testing.assert_close(exp, scores.exp())


def test_config_names_what_batch_invariant_mode_needs():
    with pytest.raises(ValueError, match="batch_invariant=True needs tensor_parallel_size=1"):
        kvlab.EngineConfig(batch_invariant=True, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="retention='full'"):
        kvlab.EngineConfig(batch_invariant=True, cache="paged", retention="window")


def test_the_batched_prompt_kernel_gives_each_sequence_its_own_calls_bits():
    from kvlab.kernels import (
        cpu_kernels_available,
        cpu_paged_prefill_attention,
        cpu_paged_prefill_attention_batch,
    )

    if not cpu_kernels_available():
        pytest.skip("the native CPU kernels are unavailable")
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 600, 3, 64, generator=gen)
    lens, rows = [300, 41, 7, 1], [40, 1, 7, 1]  # a chunk, a decode, a prompt, a first token
    slots = torch.stack([torch.randperm(600, generator=gen)[:300] for _ in lens])  # (B, S)
    q = torch.randn(sum(rows), 9, 64, generator=gen)
    starts = torch.tensor([0, *rows]).cumsum(0)
    out = cpu_paged_prefill_attention_batch(
        q, k_cache, v_cache, slots, starts, torch.tensor(lens), 0.125
    )
    for b, length in enumerate(lens):
        mine = slice(int(starts[b]), int(starts[b + 1]))
        alone = cpu_paged_prefill_attention(q[mine], k_cache, v_cache, slots[b, :length], 0.125)
        assert torch.equal(out[mine], alone), b


def test_drift_script_finds_no_changed_bits_in_batch_invariant_modes(tiny_model_path):
    from test_benchmarks import run_script

    result = run_script("drift", tiny_model_path)
    for mode, settings in result["modes"].items():
        changed = {name: row["steps_not_bit_exact"] for name, row in settings.items()}
        if "invariant" in mode:
            assert not any(changed.values()), (mode, changed)
    assert any(result["modes"]["default"][s]["steps_not_bit_exact"] for s in ("batch of 16",))


def test_cost_script_times_four_systems_on_two_workloads(tiny_model_path):
    from test_benchmarks import run_script

    result = run_script("batch_invariant", tiny_model_path)
    assert set(result["workloads"]) == {"doc-qa", "chat"}
    for timed in result["workloads"].values():
        assert len(timed["systems"]) == 4
        assert set(timed["invariant_over_default"]) == {"torch", "kernels"}
        assert all(row["tok_s_median"] > 0 for row in timed["systems"].values())
    assert len(result["load_average_before"]) == 3
