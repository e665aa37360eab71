"""SpeculativeConfig: how the engine drafts tokens and verifies them (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts up to `num_speculative_tokens` tokens per
    decoding sequence, and the model verifies them all in the step's one forward.

    Attributes:
        method: a proposer in kvlab.spec.PROPOSERS: "ngram" (prompt lookup: the tokens
            that followed an earlier occurrence of the sequence's last n tokens) or
            "layers" (self-speculation: the model's first `draft_layers` layers, then its
            final norm and LM head, draft autoregressively).
        num_speculative_tokens: k, the most tokens drafted per sequence per step.
        prompt_lookup_min: shortest n-gram "ngram" matches.
        prompt_lookup_max: longest n-gram "ngram" tries first.
        draft_layers: layers of the "layers" draft (default: a quarter of the model's).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_layers: int | None = None

    def __post_init__(self) -> None:
        from kvlab.spec import PROPOSERS

        PROPOSERS[self.method]  # its error names the field and the choices
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"SpeculativeConfig.num_speculative_tokens={self.num_speculative_tokens} "
                "must be >= 1"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"SpeculativeConfig: need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) "
                f"<= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"SpeculativeConfig.draft_layers={self.draft_layers} must be >= 1")

    @classmethod
    def coerce(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from itself, a dict of its fields (vLLM's
        `speculative_config` style), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(
                    f"EngineConfig.speculative: unknown field(s) {sorted(unknown)}; the fields "
                    f"are {list(cls.__dataclass_fields__)}"
                )
            return cls(**value)
        raise ValueError(
            f"EngineConfig.speculative={value!r} must be a SpeculativeConfig, a dict or None"
        )
