"""Which layers attend to everything and which to a sliding window, and what the window's
layers read.

Hybrid models mix layer kinds: Gemma 2/3 alternate sliding-window and full-attention
layers, Mistral 7B v0.1 slides every layer, Qwen2 slides the layers past
`max_window_layers`. A layer with a window of W tokens lets a query at position p see
the keys at positions p - W < k <= p (transformers' `sliding_window_overlay`, vLLM's
`SlidingWindowSpec`); a full-attention layer sees every k <= p.

    windows = attention_pattern(hf_config, "window=64*5,full")  # (None | W) per layer
    meta_w = windowed(meta, 64)  # what those layers read this step

A pattern is the model's own (`config.layer_types` and `config.sliding_window`, as
transformers reads them) or one set on the engine (`EngineConfig.attention_pattern`): a
comma-separated unit of `full` and `window=W` items, each optionally `*N` times, repeated
over the layers ("window=64*5,full" is Gemma 3's 5 local : 1 global).

`windowed` derives a window's metadata from the step's full metadata: a decode reads only
the last W slots of its context (so the native decode kernel, which reads slots and
lengths, computes the window as it is), a prompt's mask leaves out keys W or more behind
each query. Every layer still keeps every block here: which blocks a window's layers may
free is the cache's business (KV cache groups).
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab.model.metadata import AttentionGroup, AttentionMetadata

Pattern = tuple[int | None, ...]  # per layer: None = full attention, W = a window of W tokens


def parse_pattern(spec: str, num_layers: int) -> Pattern:
    """`spec` ("full", "window=64*5,full", ...) repeated over `num_layers` layers."""
    unit: list[int | None] = []
    for item in spec.replace(" ", "").split(","):
        kind, _, times = item.partition("*")
        count = _positive(times, spec) if times else 1
        if kind == "full":
            unit += [None] * count
        elif kind.startswith("window="):
            unit += [_positive(kind.removeprefix("window="), spec)] * count
        else:
            raise ValueError(
                f"attention_pattern={spec!r}: {item!r} is neither 'full' nor 'window=W' "
                "(each may end in '*N': e.g. 'window=64*5,full')"
            )
    return tuple(unit[i % len(unit)] for i in range(num_layers))


def _positive(text: str, spec: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"attention_pattern={spec!r}: {text!r} must be a whole number >= 1")
    return int(text)


def model_pattern(config) -> Pattern:
    """The pattern a transformers config declares (all full where it declares none)."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is None:  # Mistral slides every layer when its config has a window
        slides = config.model_type == "mistral" and window is not None
        return (window if slides else None,) * layers
    known = {"full_attention": None, "sliding_attention": window}
    unknown = sorted(set(kinds) - set(known))
    if unknown:
        raise ValueError(
            f"{config.model_type}'s layer_types has {unknown}: kvlab runs only "
            "'full_attention' and 'sliding_attention' layers"
        )
    return tuple(known[kind] for kind in kinds)


def attention_pattern(config, spec: str | None = None) -> Pattern:
    """Each layer's window: `spec`'s (see parse_pattern) or, for None, the model's own."""
    return model_pattern(config) if spec is None else parse_pattern(spec, config.num_hidden_layers)


def windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The metadata a layer with a `window`-token window reads this step (see the module
    docstring); positions and the slots new K/V go to are the step's own."""
    groups = [
        _decodes(group, window) if group.lens is not None else _prompt(group, window)
        for group in meta.groups
    ]
    return dataclasses.replace(meta, groups=groups, window=window)


def _decodes(group: AttentionGroup, window: int) -> AttentionGroup:
    """Each decode reads its last `window` context slots: (G, S) -> (G, min(S, window))."""
    lens = group.lens.clamp(max=window)  # (G,)
    width = int(lens.max())
    first = group.lens - lens  # (G,) the first position still in the window
    at = first[:, None] + torch.arange(width, device=lens.device)[None, :]  # (G, width)
    at = torch.minimum(at, group.lens[:, None] - 1)  # padding re-reads the last slot
    visible = torch.arange(width, device=lens.device)[None, :] < lens[:, None]
    return AttentionGroup(
        rows=group.rows,
        slots=group.slots.gather(1, at),
        mask=visible[:, None, None, :],  # (G, 1, 1, width)
        lens=lens,
    )


def _prompt(group: AttentionGroup, window: int) -> AttentionGroup:
    """A prompt's rows see the keys less than `window` positions behind them."""
    queries, keys = group.rows.stop - group.rows.start, group.slots.shape[1]
    device = group.slots.device
    query_pos = torch.arange(keys - queries, keys, device=device)[:, None]  # (Q, 1)
    key_pos = torch.arange(keys, device=device)[None, :]  # (1, S)
    mask = (key_pos <= query_pos) & (key_pos > query_pos - window)  # (Q, S)
    return dataclasses.replace(group, mask=mask[None, None])  # (1, 1, Q, S)
