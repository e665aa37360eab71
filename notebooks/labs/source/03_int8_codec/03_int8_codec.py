# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: nbgrader,tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 3 · An int8 KV codec
#
# K and V of a token take `2 × layers × kv_heads × head_dim` numbers. Stored in int8 instead
# of bf16 they take half the bytes, so the same memory holds about twice the tokens. The
# codec here is **symmetric** with **one scale per token per KV head**:
#
# * `s = max |x| / 127` over the head's `head_dim` values;
# * codes `q = round(x / s)`, in [−127, 127], stored as int8; the scale is stored beside
#   them (kvlab keeps it in bf16: 2 bytes per token per head);
# * decoding is `q × s`, and rounding to the nearest code errs by at most **s / 2**.
#
# Why per token per head, not one scale for the whole tensor? Heads differ in size (some
# keys have outlier heads 10-100 times larger than others), and with a shared scale the
# small heads get only a few of the 255 levels. Why per token? A token's scale is final
# when it is written: nothing has to be re-quantized as the sequence grows.
#
# Your task: `quantize_int8` and `dequantize_int8`. The grader checks the error bound that
# kvlab's own `Int8` codec passes (`tests/test_codecs.py`), on tensors shaped like real
# K/V, and compares your codec with kvlab's.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import torch

from kvlab.labs import check_int8_codec

# %% [markdown]
# ## The exercise
#
# `x` has shape `(T, H, D)`: tokens, KV heads, head_dim. Useful: `x.abs().amax(dim=-1)`
# (the largest |x| per token per head, shape `(T, H)`), `s[..., None]` (broadcast a scale
# over the head's values), `.round()`, `.clamp(-127, 127)`, `.to(torch.int8)`,
# `torch.where(s > 0, s, 1.0)`.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H, D) float -> int8 codes (T, H, D) and one scale per token per head (T, H)."""
    # TODO: s = the largest |x| of each token's head, divided by 127. Codes: x / s rounded
    #       to the nearest integer, kept within [-127, 127], as int8. An all-zero head has
    #       s = 0: give it codes 0 (no division by zero).
    ### BEGIN SOLUTION
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127  # (T, H): the head's largest |x| maps to 127
    safe = torch.where(scale > 0, scale, 1.0)[..., None]  # an all-zero head: codes 0
    q = (x / safe).round().clamp(-127, 127)
    return q.to(torch.int8), scale
    ### END SOLUTION


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes (T, H, D) and scales (T, H) -> float32 (T, H, D)."""
    # TODO
    ### BEGIN SOLUTION
    return q.float() * scale.float()[..., None]
    ### END SOLUTION


# %% [markdown]
# ## Try it

# %% tags=["raises-exception"]
gen = torch.Generator().manual_seed(0)
sizes = torch.tensor([1.0, 8.0, 0.1])  # three KV heads of very different size
k = torch.randn(4, 3, 64, generator=gen) * sizes[None, :, None]
q, scale = quantize_int8(k)
err = (dequantize_int8(q, scale) - k).abs().amax(-1)  # worst error per token and head
shared = k.abs().max() / 127  # one scale for the whole tensor, for comparison
err_shared = ((k / shared).round() * shared - k).abs().amax(-1)
print("bytes per token per head: bf16", 64 * 2, "| int8", 64 + 2, "(codes + a bf16 scale)")
print("worst error per head, own scales:  ", [round(e, 4) for e in err.amax(0).tolist()])
print("worst error per head, shared scale:", [round(e, 4) for e in err_shared.amax(0).tolist()])

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected.

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_int8_codec(quantize_int8, dequantize_int8)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_shapes_and_dtypes", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "shapes and dtypes".
# Graded also on random cases not shown here (hidden tests).
### BEGIN HIDDEN TESTS
hidden = check_int8_codec(quantize_int8, dequantize_int8, verbose=False, seed=2026)
### END HIDDEN TESTS
result.raise_for_check("shapes and dtypes")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("shapes and dtypes")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_error_bound_on_k_v_like_tensors", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 3 points: the check "error bound on K/V-like tensors".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("error bound on K/V-like tensors")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("error bound on K/V-like tensors")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_error_bound_from_1e_20_to_1e30", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "error bound from 1e-20 to 1e30".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("error bound from 1e-20 to 1e30")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("error bound from 1e-20 to 1e30")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_symmetric_code_range", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "symmetric code range".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("symmetric code range")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("symmetric code range")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_zeros_and_all_zero_heads", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "zeros and all-zero heads".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("zeros and all-zero heads")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("zeros and all-zero heads")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_agrees_with_kvlab_s_int8_codec", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "agrees with kvlab's Int8 codec".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("agrees with kvlab's Int8 codec")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("agrees with kvlab's Int8 codec")
### END HIDDEN TESTS

# %% [markdown]
# ## What the grader checks
#
# Shapes and dtypes (int8 codes, a `(T, H)` scale, float32 output); `|x − x̂| ≤ s / 2` for
# every element on K/V-like tensors (heads of different size, outlier channels, zeros) and
# at magnitudes from 1e-20 to 1e30; codes within [−127, 127]; zeros that come back exactly;
# and agreement with kvlab's `Int8` codec within one step. A failure is cut down to the
# smallest slice of the tensor that still fails.
#
# ## What to try next
#
# * Store the scale in `torch.float16` and run the grader: which magnitudes break, and why
#   does kvlab store scales in bfloat16?
# * Serve the real model with `EngineConfig(kv_codec="int8")` and compare its greedy output
#   and perplexity with the baseline (the quantization notebook does this for every codec).
# * vLLM's fp8 KV cache uses by default one scale per layer for K and one for V (1.0 unless
#   calibrated; [quantized KV cache](https://github.com/vllm-project/vllm/blob/main/docs/features/quantization/quantized_kvcache.md)):
#   fp8 has an exponent, so a shared scale hurts it far less than int8. kvlab's
#   `kv_codec="fp8_e4m3"` keeps a scale per token per head, like this lab's int8: try it,
#   then quantize a K tensor to `torch.float8_e4m3fn` with a scale of 1.0 and compare.
