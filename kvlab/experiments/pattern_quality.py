"""What a sliding-window pattern costs a model that was not trained with one.

    frame = pattern_quality(model, quality.heldout_ids(model, 2048), ["window=128*5,full"])

Gemma 3 was trained with 5 sliding-window layers to 1 full one; SmolLM2 and the other
Llama-family models were not. Given such a pattern (kvlab.model.pattern), a model whose
layers learned to read every earlier token reads only the last W in most layers: the
K/V a hybrid KV cache would no longer hold. This measures what that costs: the held-out
text fed through the runner in chunks with the pattern and with every layer full, on
the same tokens. Per pattern: perplexity, its change against all-full with a 95%
interval from the paired per-token log losses (kvlab.experiments.quality), and how often
the next-token argmax agrees with all-full's.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch
import torch.nn.functional as F

from kvlab.cache.pool import KVPool
from kvlab.experiments.quality import paired_interval
from kvlab.model.loading import LoadedModel
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.pattern import attention_pattern
from kvlab.model.runner import ModelRunner

FULL = "full"  # every layer full attention: the reference row


def pattern_quality(
    model: LoadedModel, ids: Sequence[int], patterns: Sequence[str], chunk: int = 128
) -> pd.DataFrame:
    """One row per pattern (all-full first): ppl, ppl_vs_full_pct with its interval
    (ppl_pct_low, ppl_pct_high), top1_agreement with all-full, sliding_layers, tokens."""
    if len(ids) < 2:
        raise ValueError(f"need at least 2 token ids to score; got {len(ids)}")
    base_nll, base_top = _score(model, ids, FULL, chunk)
    rows = []
    for spec in [FULL, *patterns]:
        nll, top = (base_nll, base_top) if spec == FULL else _score(model, ids, spec, chunk)
        low, high = paired_interval(nll - base_nll)
        rows.append(
            {
                "pattern": spec,
                "sliding_layers": sum(w is not None for w in attention_pattern(model.config, spec)),
                "ppl": float(nll.mean().exp()),
                "ppl_vs_full_pct": 100 * float((nll.mean() - base_nll.mean()).exp() - 1),
                "ppl_pct_low": low,
                "ppl_pct_high": high,
                "top1_agreement": float((top == base_top).double().mean()),
                "tokens": len(nll),
            }
        )
    return pd.DataFrame(rows)


@torch.inference_mode()
def _score(
    model: LoadedModel, ids: Sequence[int], spec: str, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per predicted token of ids[1:]: its log loss (float64) and the argmax, (n,) each,
    with `spec`'s pattern; the text goes in `chunk`-token pieces, as a chunked prefill."""
    runner = ModelRunner(model.hf_model, pattern=attention_pattern(model.config, spec))
    n = len(ids) - 1
    pool = KVPool(runner.kv_spec, n, runner.dtype, runner.device)
    tokens = torch.tensor(ids, dtype=torch.long, device=runner.device)
    nlls, tops = [], []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        meta = build_attention_metadata([start], [end - start], [[0]], n, runner.device)
        logp = F.log_softmax(runner.forward(tokens[start:end], meta, pool, all_logits=True), -1)
        nlls.append(-logp.gather(1, tokens[start + 1 : end + 1, None])[:, 0].double().cpu())
        tops.append(logp.argmax(-1).cpu())
    return torch.cat(nlls), torch.cat(tops)
