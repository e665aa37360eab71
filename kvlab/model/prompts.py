"""Prompts to token ids, the one way every part of kvlab encodes them."""

from __future__ import annotations


def encode_prompt(tokenizer, prompt: str | list[int], chat: bool | None = None) -> list[int]:
    """Token ids of a prompt: strings get the chat template when the tokenizer has one
    (unless `chat=False`); token-id lists pass through as ints."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return list(tokenizer.encode(prompt))


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat ({role, content} messages) through the model's chat template,
    ending with the assistant's turn; ValueError if the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
