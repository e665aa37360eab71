"""vLLM's n-gram speculative decoding on kvlab's prompts (kvlab.experiments.spec_vllm).

Skipped where `make peers` cannot build `.venv-vllm`. One vLLM worker starts two engines
(no speculation, then n-gram k = 2) on the embedded model, fp32, greedy, EOS ignored.
"""

from __future__ import annotations

import pytest

import kvlab
from kvlab.experiments.spec_vllm import ngram_config, vllm_runs
from kvlab.experiments.speculative import spec_workloads
from kvlab.experiments.vllm_peer import vllm_missing

pytestmark = pytest.mark.skipif(bool(vllm_missing()), reason=str(vllm_missing()))


def test_ngram_config_uses_vllms_names():
    assert ngram_config(0, 2, 4) is None
    assert ngram_config(3, 2, 4) == {"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4}  # fmt: skip


def test_vllm_ngram_drafts_and_keeps_the_greedy_tokens(model):
    [request] = spec_workloads(model, 1, 0, 24)["doc-qa"]  # a 1,692-token document
    plain, ngram = vllm_runs(model, "doc-qa", [request], (2,), 2, 4)
    assert (plain.system, plain.k, ngram.method, ngram.k) == ("vllm", 0, "ngram", 2)
    assert ngram.outputs == plain.outputs and len(plain.outputs[0]) == 24
    assert 0 < ngram.accepted <= ngram.drafted  # an answer that quotes its document
    assert ngram.decode_forwards < plain.decode_forwards == 23  # accepted drafts save forwards
    # vLLM's greedy answer is kvlab's, token for token
    engine = kvlab.Engine(model, kvlab.EngineConfig(cache="paged", max_model_len=2048))
    params = kvlab.SamplingParams(max_new_tokens=24, ignore_eos=True)
    [ours] = engine.generate([list(request.prompt)], params)
    assert ours.token_ids == plain.outputs[0]
