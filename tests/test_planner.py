"""Capacity planner: exact arithmetic on shipped configs, the CLI, the app, and the engine check."""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main
from kvlab.experiments.capacity_check import check_against_engine
from kvlab.planner import (
    MODELS,
    ModelShape,
    capacity_curve,
    gqa_vs_mha,
    kv_bytes_per_token,
    plan,
    predict_engine_capacity,
    weight_bytes,
)
from kvlab.units import parse_size
from kvlab.viz.planner import PlannerApp

# Published parameter counts of the shipped configs (model cards / safetensors metadata).
PARAMS = {
    "SmolLM2-135M": 134_515_008,
    "Llama-3-8B": 8_030_261_248,
    "Mistral-7B": 7_241_732_096,
    "Qwen2.5-7B": 7_615_616_512,
    "Llama-3-70B": 70_553_706_496,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_shipped_configs_have_the_published_parameter_counts(name):
    assert ModelShape.from_config(name).num_params() == PARAMS[name]


def test_shipped_smollm2_config_matches_the_embedded_model(model):
    embedded = ModelShape.from_config(model.config)
    shipped = ModelShape.from_config("SmolLM2-135M")
    assert embedded.num_params() == sum(p.numel() for p in model.hf_model.parameters())
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
        assert getattr(embedded, field) == getattr(shipped, field)
    assert shipped.tie_word_embeddings and shipped.max_position_embeddings == 8192


def test_kv_bytes_per_token_counts_scales_of_quantized_dtypes():
    llama = ModelShape.from_config("Llama-3-8B")  # 32 layers, 8 KV heads, head_dim 128
    assert kv_bytes_per_token(llama, "bf16") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(llama, "fp32") == 262_144
    # int8: one byte per element plus a bf16 scale per token per KV head.
    assert kv_bytes_per_token(llama, "int8") == 2 * 32 * (8 * 128 + 8 * 2) == 66_560
    assert kv_bytes_per_token(llama.with_mha(), "bf16") == 4 * 131_072
    with pytest.raises(ValueError, match="kv_codec='int3' is unknown"):
        kv_bytes_per_token(llama, "int3")


def test_plan_arithmetic_is_exact_for_llama_3_8b_on_80_gib():
    p = plan("Llama-3-8B", memory="80GiB", context_len=8192, users=32)
    weights = 8_030_261_248 * 2
    activations = 4096 * (4 * 4096 + 2 * 1024 + 3 * 14336) * 2 + 256 * 128256 * 4
    budget = int(80 * 2**30 * 0.9) - weights - activations
    tokens = budget // 131_072
    assert (p.weight_bytes, p.activation_bytes, p.kv_budget_bytes) == (weights, activations, budget)
    assert (p.kv_tokens, p.num_blocks) == (tokens, tokens // 16) == (462_449, 28_903)
    assert p.paged_max_seqs == 28_903 // 512 == 56
    assert p.naive_max_seqs == tokens // 8192 == 56  # context = max_model_len: no waste
    assert p.oom_users == 57
    assert p.users_fit and p.oom_context is None  # 32 users reach max_model_len
    assert p.users_kv_bytes == 32 * 8192 * 131_072


def test_where_users_run_out_of_memory_and_block_rounding():
    p = plan("Llama-3-8B", memory="24GiB", context_len=4000, users=32)
    # 4,000 tokens take 250 blocks of 16; naive reserves all 8,192 tokens per sequence.
    assert p.paged_max_seqs == p.num_blocks // 250
    assert p.naive_max_seqs == p.kv_tokens // 8192
    assert not p.users_fit
    assert p.users_max_context == (p.num_blocks // 32) * 16
    assert p.oom_context == p.users_max_context + 1
    coarse = plan("Llama-3-8B", memory="24GiB", context_len=4000, block_size=256)
    assert coarse.paged_max_seqs == (coarse.kv_tokens // 256) // 16  # 4,000 -> 16 x 256


def test_capacity_curve_and_gqa_vs_mha():
    curve = capacity_curve("Mistral-7B", [1024, 4096], memory="80GiB")
    assert curve["context_len"].tolist() == [1024, 4096]
    assert (curve["paged"] >= 3 * curve["paged_mha"]).all()  # 32 query heads / 8 KV heads
    table = gqa_vs_mha("Qwen2.5-7B", memory="80GiB", context_len=4096)
    assert table["KV bytes/token"].tolist() == [57_344, 7 * 57_344]  # 28 heads / 4 KV heads


def test_tensor_parallel_splits_weights_and_kv_heads_per_device():
    alone = plan("Llama-3-70B", memory="80GiB", context_len=4096)
    assert alone.paged_max_seqs == 0 and alone.kv_budget_bytes == 0  # 131 GiB of weights
    for tp, kv_heads in ((2, 4), (4, 2), (8, 1), (16, 1)):  # 16 > 8 KV heads: replicated
        p = plan("Llama-3-70B", memory="80GiB", context_len=4096, tensor_parallel_size=tp)
        assert p.tensor_parallel_size == tp and p.kv_heads_per_rank == kv_heads
        assert p.weight_bytes == -(-alone.weight_bytes // tp)  # each device's shard
        assert p.kv_bytes_per_token == 2 * 80 * kv_heads * 128 * 2  # bf16, 80 layers
        assert p.kv_tokens == p.kv_budget_bytes // p.kv_bytes_per_token
    four = plan("Llama-3-70B", memory="80GiB", context_len=4096, tensor_parallel_size=4)
    assert four.paged_max_seqs > 100 and "tensor parallel over 4 devices" in four.summary()
    one = plan("Llama-3-8B", memory="80GiB", tensor_parallel_size=1)
    assert one == plan("Llama-3-8B", memory="80GiB") and one.kv_heads_per_rank is None
    with pytest.raises(ValueError, match="must divide the 64 query heads"):
        plan("Llama-3-70B", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="the 4 KV heads must divide one another"):
        plan("Qwen2.5-7B", tensor_parallel_size=14)  # 28 query heads, 4 KV heads


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="size '80 gigs' is not understood"):
        parse_size("80 gigs")
    assert parse_size("80GiB") == 80 * 2**30 and parse_size("24GB") == 24 * 10**9
    with pytest.raises(ValueError, match="context_len=9000 exceeds max_model_len=8192"):
        plan("Llama-3-8B", context_len=9000)
    with pytest.raises(ValueError, match="neither a shipped config"):
        ModelShape.from_config("Llama-9-1T")
    with pytest.raises(ValueError, match="weight_dtype='fp64' is unknown"):
        weight_bytes(ModelShape.from_config("Llama-3-8B"), "fp64")


def test_plan_cli_json(capsys, tmp_path):
    assert (
        main(
            [
                "plan",
                "--model",
                "Llama-3-8B",
                "--memory",
                "80GiB",
                "--context",
                "8192",
                "--users",
                "32",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"plan", "mha"}
    assert result["plan"]["paged_max_seqs"] == 56 and result["plan"]["oom_users"] == 57
    assert result["mha"]["kv_bytes_per_token"] == 4 * result["plan"]["kv_bytes_per_token"]
    config = tmp_path / "config.json"  # any HF config.json works
    config.write_text(
        json.dumps(
            {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
        )
    )
    assert main(["plan", "--model", str(config), "--memory", "1GiB", "--context", "1024"]) == 0
    assert "MHA (4 query / 4 KV heads)" in capsys.readouterr().out
    args = ["plan", "--model", "Llama-3-70B", "--tensor-parallel-size", "4", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["kv_heads_per_rank"] == 2


def test_planner_app_follows_its_widgets():
    app = PlannerApp(model="Llama-3-8B", memory_gib=80, context_len=8192, users=32)
    paged, naive, mha = app.figure.data[:3]
    curve = capacity_curve("Llama-3-8B", memory=80 * 2**30)
    assert list(paged.y) == curve["paged"].tolist() and list(mha.y) == curve["paged_mha"].tolist()
    assert "paged 56 sequences" in app.summary.value
    offered = [value for _label, value in app.memory.options]  # round sizes, 80 among them
    assert app.memory.value == 80 and 141 in offered and offered == sorted(offered)
    app.users.value = 64
    assert "do NOT fit" in app.figure.layout.title.text
    app.kv_codec.value = "int8"
    assert app.plan.kv_bytes_per_token == 66_560 and app.plan.users_fit
    app.model.value = "Llama-3-70B"
    weights = app.figure.data[3]
    assert weights.y[0] == pytest.approx(70_553_706_496 * 2 / 2**30)
    app.context.value = 16384  # beyond Llama-3's 8,192 window: a message, no crash
    assert "exceed" in app.summary.value


@pytest.mark.parametrize(
    ("cache", "max_model_len", "expected"),
    [("paged", 128, 6), ("naive", 64, 3)],  # by hand below
    ids=["paged", "naive"],
)
def test_planner_matches_the_engines_measured_capacity(model, cache, max_model_len, expected):
    budget = 9_000_000  # bytes: ~195 token slots of SmolLM2's 46,080-byte fp32 KV
    check = check_against_engine(
        model, budget, prompt_len=24, output_len=8, cache=cache, max_model_len=max_model_len
    )
    # By hand from the config, not through the planner: K and V, every layer and kv head,
    # fp32. 9,000,000 // 46,080 = 195 slots. Paged: 195 // 16 = 12 blocks, and a sequence
    # of 24 + 8 = 32 tokens takes 2 of them: 6. Naive: 195 // max_model_len 64 = 3.
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    slots = budget // per_token
    by_hand = slots // 16 // 2 if cache == "paged" else slots // max_model_len
    assert (per_token, slots, by_hand) == (46_080, 195, expected)
    planned = predict_engine_capacity(c, budget, 32, cache, 16, None, model.dtype, max_model_len)
    assert planned == expected and check.predicted == expected
    assert abs(check.error) <= 0.05, check
