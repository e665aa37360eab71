"""The model: loading a Llama-family checkpoint and kvlab's own forward over the KV pool.

loading.py           the embedded GGUF model (cached as safetensors) or any HF Llama
prompts.py           prompts to token ids (the chat template)
runner.py            RMSNorm, RoPE, GQA, SwiGLU: one batched forward per step
metadata.py          per-step positions, slot mapping, each sequence's context slots
attention.py         attention over the pool in plain torch (the kernels' reference)
kernel_attention.py  decode steps through kvlab.kernels
"""
