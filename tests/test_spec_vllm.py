"""vLLM's n-gram speculative decoding on kvlab's prompts (kvlab.peers.spec_vllm,
kvlab.experiments.speculative.vllm_runs).

Skipped where `make peers` cannot build `.venv-vllm`. One vLLM engine with n-gram k = 2
(its counting pass, stats on; no timed twin) on the embedded model, fp32, greedy, EOS ignored; its
tokens are checked against kvlab's
(tests/test_vllm_oracle.py checks vLLM's plain greedy tokens against kvlab's), so no
second engine without speculation is started.
"""

from __future__ import annotations

import pytest

import kvlab
from kvlab.experiments.speculative import spec_workloads, vllm_runs
from kvlab.peers.spec_vllm import ngram_config
from kvlab.peers.vllm_peer import vllm_missing

pytestmark = pytest.mark.skipif(bool(vllm_missing()), reason=str(vllm_missing()))


def test_ngram_config_uses_vllms_names():
    assert ngram_config(0, 2, 4) is None
    assert ngram_config(3, 2, 4) == {"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4}  # fmt: skip


def test_vllm_ngram_drafts_and_keeps_the_greedy_tokens(model):
    [request] = spec_workloads(model, 1, 0, 24, seed=4)["doc-qa"]  # a 741-token document
    # one engine: the counting pass (stats on), whose tokens a timed run must equal
    [ngram] = vllm_runs(model, "doc-qa", [request], (2,), 2, 4, baseline=False, timed=False)
    # eager at block 32, and named so
    assert (ngram.system, ngram.method, ngram.k) == ("vllm (eager, block 32)", "ngram", 2)
    # drafted and accepted from vLLM's SpecDecodingStats
    assert 0 < ngram.accepted <= ngram.drafted  # an answer that quotes its document
    # accepted drafts save forwards: one token per forward would take 23 after the prompt's
    assert ngram.decode_forwards < 23
    # vLLM's speculated greedy answer is kvlab's, token for token
    engine = kvlab.Engine(model, kvlab.EngineConfig(cache="paged", max_model_len=1024))
    params = kvlab.SamplingParams(max_new_tokens=24, ignore_eos=True)
    [ours] = engine.generate([list(request.prompt)], params)
    assert ngram.outputs == [ours.token_ids] and len(ours.token_ids) == 24
