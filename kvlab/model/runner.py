"""kvlab's own Llama-family forward pass, reading and writing K/V through a KVPool.

Embedding -> N x [RMSNorm -> QKV (+bias for Qwen2) -> RoPE -> GQA attention over the
pool -> O proj -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head
(tied to the embedding when the model ties them). Weights are the transformers model's
own tensors; Q/K/V and gate/up projections are fused into one matmul each, and on the
CPU every linear weight is packed for oneDNN (kvlab.model.linear). Both are done once
per model and shared by every runner: an engine costs no weight copy.

All tokens of a step, from every running sequence, are packed into one (T, hidden)
matrix, so each linear layer runs once per step for the whole batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.cache.pool import KVPool
from kvlab.cache.spec import KVSpec
from kvlab.model.attention import pooled_attention
from kvlab.model.host_memory import keep_freed_memory
from kvlab.model.linear import AmxLinears, Linears, StreamLinears
from kvlab.model.metadata import AttentionMetadata
from kvlab.model.pattern import Pattern, model_pattern, windowed

AttentionFn = Callable[[torch.Tensor, int, KVPool, AttentionMetadata, float], torch.Tensor]
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # hf model -> FusedModel


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # ((heads + 2 * kv_heads) * head_dim, hidden)
    qkv_bias: torch.Tensor | None  # Qwen2 has one; Llama and Mistral do not
    o: torch.Tensor  # (hidden, heads * head_dim)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (2 * intermediate, hidden)
    down: torch.Tensor  # (hidden, intermediate)


@dataclass
class FusedModel:
    """A model's fused layer weights, and its matmuls once first asked for; one per
    model, shared by every runner of it."""

    layers: list[LayerWeights]
    linear: Linears | None = None
    amx: AmxLinears | None = None  # a bf16 decode step's matmuls on AMX, once first asked for
    stream: StreamLinears | None = None  # a decode step's streamed matmuls, once first asked for


def kv_spec_of(config) -> KVSpec:
    """The KV shape of a Llama-family transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVSpec(config.num_hidden_layers, config.num_key_value_heads or heads, head_dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, computed in fp32 like the reference implementation."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up."""
    return F.silu(gate).mul_(up)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, the reference's RoPE bit for bit, in fewer passes
    (no negated or concatenated copy of x): x (T, heads, head_dim), cos and sin
    (T, head_dim). rotate_half(x) is (-x2, x1) for x's halves (x1, x2)."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


class ModelRunner:
    """Runs the model on packed tokens; attention goes through `attention_fn`."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        attention_fn: AttentionFn = pooled_attention,
        batch_invariant: bool = False,
        pattern: Pattern | None = None,
        fused_ops: bool = False,
    ):
        """`attention_fn`: kvlab.model.attention_chain builds the one an engine asks for;
        `batch_invariant`: matmuls whose rows sum in an order fixed by the row alone
        (kvlab.model.invariant); `pattern`: each layer's sliding window or None for full
        attention (kvlab.model.pattern), the model's own if not given; `fused_ops`: a bf16
        or fp32 model's norms, residual adds, RoPE and SwiGLU through the native CPU kernels
        (kvlab.kernels.cpu_fused) where they run, one call each instead of torch's chains,
        and a decode step's matmuls through kvlab's own kernels where they pay."""
        cfg = hf_model.config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r}: kvlab's MLP is SwiGLU (silu)")
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.kv_spec = kv_spec_of(cfg)
        self.attention_fn = attention_fn
        self.windows = pattern or model_pattern(cfg)  # (None | W) per layer
        # per layer: (KV cache group, pool layer); one group of every layer by default
        self.kv_layers = [(0, layer) for layer in range(len(self.windows))]

        base = hf_model.model
        self.embed = base.embed_tokens.weight  # (vocab, hidden)
        self.final_norm = base.norm.weight
        self.lm_head = hf_model.lm_head.weight  # the embedding itself when tied
        # RoPE: inv_freq[i] = theta^(-2i/head_dim), already adjusted by any rope scaling.
        self.inv_freq = base.rotary_emb.inv_freq.float()
        self.rope_scale = float(getattr(base.rotary_emb, "attention_scaling", 1.0))
        fused = _FUSED.get(hf_model)
        if fused is None or fused.layers[0].qkv.device != self.embed.device:  # first, or moved
            fused = _FUSED[hf_model] = FusedModel([self._layer_weights(x) for x in base.layers])
        self.layers, self.linear = self._weights(fused)
        self.device, self.dtype = self.embed.device, self.embed.dtype
        if self.device.type == "cpu":  # a step's large buffers reuse pages, not fault anew
            keep_freed_memory()
        self.norm, self.silu_mul, self.apply_rope = rms_norm, silu_mul, apply_rope
        self.fused_add_norm = None  # (h, delta, weight, eps) -> norm: one native call
        self.layer_kernels = None  # a decode step's layers in two native calls each
        self.fused_ops = fused_ops and not batch_invariant and self._fused_runs(cfg)
        if self.fused_ops:
            from kvlab.kernels import cpu_fused

            self.silu_mul, self.apply_rope = cpu_fused.cpu_silu_mul, cpu_fused.cpu_rope
            self.fused_add_norm = cpu_fused.cpu_add_rms_norm
            self.linear = self._packed_linears(fused)
            self.layer_kernels = self._layer_kernels()
        if batch_invariant:  # every reduction in kvlab's fixed order (kvlab.model.invariant)
            from kvlab.model import invariant

            invariant.check_invariant_runs(self.device)
            self.linear = invariant.InvariantLinears()
            self.norm, self.silu_mul = invariant.invariant_rms_norm, invariant.invariant_silu_mul
            self.rope = invariant.InvariantRope(self.inv_freq, self.rope_scale, self.dtype)

    def _fused_runs(self, cfg) -> bool:
        """Whether the fused elementwise kernels take this model: bf16 or fp32 on the CPU,
        the native kernels built, and sizes that fit their vectors."""
        if self.dtype not in (torch.bfloat16, torch.float32) or self.device.type != "cpu":
            return False
        from kvlab.kernels import cpu_kernels_available
        from kvlab.kernels.cpu_fused import fused_fits

        sizes = cfg.hidden_size, cfg.intermediate_size, self.head_dim
        return cpu_kernels_available() and fused_fits(*sizes)

    def _packed_linears(self, fused: FusedModel) -> Linears | AmxLinears | StreamLinears:
        """A fused runner's matmuls, packed once per model: bf16 steps of up to 32 rows on
        AMX tiles where the CPU has them (kvlab.model.linear.AmxLinears), fp32 steps, and
        bf16 steps elsewhere, of up to 32 rows through kvlab's vector stream where it pays
        (StreamLinears), else oneDNN's."""
        from kvlab.kernels.cpu_prefill import amx_ready
        from kvlab.kernels.cpu_stream import stream_pays

        weights = self.matmul_weights(self.layers)
        if self.dtype == torch.bfloat16 and amx_ready():
            if fused.amx is None:
                fused.amx = AmxLinears(self.linear, weights)
            return fused.amx
        if self.dtype in (torch.float32, torch.bfloat16) and stream_pays(self.dtype):
            if fused.stream is None:
                fused.stream = StreamLinears(self.linear, weights, self.dtype)
            return fused.stream
        return self.linear

    def _layer_kernels(self):
        """A fused runner's decode steps, each layer in two native calls around attention
        (kvlab.kernels.cpu_layer), where every matmul of every layer is packed for kvlab's
        own kernels (AMX tiles or the stream); else None."""
        if not isinstance(self.linear, AmxLinears | StreamLinears):
            return None
        from kvlab.kernels.cpu_layer import LayerKernels, PackedLayer

        packed = []
        for w in self.layers:
            mats = [self.linear.packed.get(x.data_ptr()) for x in (w.qkv, w.o, w.gate_up, w.down)]
            if None in mats:
                return None
            qkv, o, gate_up, down = mats
            packed.append(PackedLayer(w.input_norm, qkv, w.qkv_bias, o, w.post_norm, gate_up, down))
        return LayerKernels(packed, self.num_heads, self.num_kv_heads, self.head_dim, self.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        """h += delta (the residual stream takes a sublayer's output, when there is one),
        then h's RMS norm: (T, hidden) -> (T, hidden). One native call when fused."""
        if self.fused_add_norm is not None:
            return self.fused_add_norm(h, delta, weight, self.eps)
        if delta is not None:
            h += delta
        return self.norm(h, weight, self.eps)

    def _weights(self, fused: FusedModel) -> tuple[list[LayerWeights], Linears]:
        """The layers this runner computes and their matmuls: the whole model's, the
        matmuls packed on first use and shared."""
        if fused.linear is None:
            fused.linear = self.pack(fused.layers)
        return fused.layers, fused.linear

    def pack(self, layers: list[LayerWeights]) -> Linears:
        """The matmuls over `layers`' weights and the LM head (kvlab.model.linear)."""
        return Linears(self.matmul_weights(layers))

    def matmul_weights(self, layers: list[LayerWeights]) -> list[torch.Tensor]:
        """The LM head's and `layers`' linear weights, in the order a step uses them."""
        return [self.lm_head] + [x for w in layers for x in (w.qkv, w.o, w.gate_up, w.down)]

    def use_kv_groups(self, groups: list) -> None:
        """Read and write each layer's K/V where its KV cache group keeps them
        (kvlab.cache.groups): layer `group.layers[i]` in pool layer i, through group g's
        metadata (`forward` is then handed one metadata per group)."""
        for g, group in enumerate(groups):
            for slot, layer in enumerate(group.layers):
                if self.windows[layer] != group.window:
                    raise ValueError(f"layer {layer} has window {self.windows[layer]}, its "
                                     f"KV cache group {g} {group.window}")  # fmt: skip
                self.kv_layers[layer] = (g, slot)

    def use_attention(self, fn: AttentionFn) -> AttentionFn:
        """Compute attention with `fn` from now on (another backend, a wrapper that scores
        what each query reads); returns the one it replaces, to put back."""
        previous, self.attention_fn = self.attention_fn, fn
        return previous

    @staticmethod
    def _layer_weights(layer: torch.nn.Module) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        has_bias = attn.q_proj.bias is not None
        return LayerWeights(
            input_norm=layer.input_layernorm.weight,
            qkv=torch.cat([p.weight for p in projections]).detach(),
            qkv_bias=torch.cat([p.bias for p in projections]).detach() if has_bias else None,
            o=attn.o_proj.weight,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
            down=mlp.down_proj.weight,
        )

    def qkv(
        self,
        index: int,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `index` up to attention: h += delta (the previous MLP's output, when there
        is one), then Q, K and V of h's norm, Q's and K's heads rotated (RoPE).
        h, delta: (T, hidden); cos, sin: (T, head_dim) -> q (T, heads, head_dim), k and v
        (T, kv_heads, head_dim)."""
        w, heads, kv_heads = self.layers[index], self.num_heads, self.num_kv_heads
        x = self.add_norm(h, delta, w.input_norm)
        qkv = self.linear(x, w.qkv, w.qkv_bias)  # (T, (heads + 2 kv_heads) * head_dim)
        qk = qkv[:, : (heads + kv_heads) * self.head_dim].view(-1, heads + kv_heads, self.head_dim)
        q, k = self.apply_rope(qk, cos, sin).split([heads, kv_heads], dim=1)  # rotate alike
        v = qkv[:, (heads + kv_heads) * self.head_dim :].view(-1, kv_heads, self.head_dim)
        return q, k, v

    def mlp(self, index: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Layer `index` after attention: h += attn's O projection, then the SwiGLU MLP of
        h's norm. h: (T, hidden); attn: (T, heads * head_dim) -> (T, hidden)."""
        w = self.layers[index]
        x = self.add_norm(h, self.reduce(self.linear(attn, w.o)), w.post_norm)
        gate, up = self.linear(x, w.gate_up).chunk(2, dim=-1)
        return self.reduce(self.linear(self.silu_mul(gate, up), w.down))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's output over tensor-parallel ranks (identity here:
        one process holds every head; kvlab.parallel's ShardedRunner all-reduces)."""
        return partial

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the given positions: (T, head_dim) each."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (T, head_dim/2)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos() * self.rope_scale, angles.sin() * self.rope_scale
        return cos.to(self.dtype), sin.to(self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        pool: KVPool,
        all_logits: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step for the whole batch.

        input_ids: (T,) new tokens, packed sequence by sequence.
        meta: the step's metadata, or one per KV cache group (`use_kv_groups`): each
        group's tokens are written to and read from its own blocks.
        Returns logits (B, vocab) at each sequence's last new token, or (T, vocab) if
        `all_logits` (teacher-forced scoring), or (len(logits_at), vocab) at the rows of T
        `logits_at` names (speculative verification).
        """
        metas = meta if isinstance(meta, list) else [meta]  # per KV cache group
        meta = metas[0]  # positions and the rows of last tokens are every group's
        h = self.embed[input_ids]  # (T, hidden): the residual stream, this step's own
        cos, sin = self.rope(meta.positions)  # (T, head_dim) each
        n_q = self.num_heads * self.head_dim
        views = {}  # (group, window) -> what those layers read: the group's, or its window's
        mlp = None  # the previous layer's MLP output, which the next norm adds to h
        # a decode step on kvlab's own matmuls: the same ops in two native calls a layer
        ops = self.layer_kernels if self.layer_kernels and self.layer_kernels.takes(h) else self
        for index in range(len(self.layers)):
            q, k, v = ops.qkv(index, h, mlp, cos, sin)  # h += mlp, norm, QKV, RoPE on Q, K
            group, slot, window = *self.kv_layers[index], self.windows[index]
            pool.write(slot, metas[group].slot_mapping, k, v)
            if (group, window) not in views:
                full = metas[group]
                views[group, window] = full if window is None else windowed(full, window)
            attn = self.attention_fn(
                q, slot, pool, views[group, window], self.scale
            )  # (T, heads, dim)
            mlp = ops.mlp(index, h, attn.reshape(-1, n_q))  # h += O(attn), norm, SwiGLU MLP
        h += mlp
        if logits_at is not None:
            h = h[logits_at]  # (R, hidden)
        elif not all_logits:
            h = h[meta.last_token_index]  # (B, hidden)
        return self.linear(self.norm(h, self.final_norm, self.eps), self.lm_head).float()
