"""Speculative decoding: kvlab's n-gram and "layers" drafts beside HF's and vLLM's.

    python benchmarks/speculative.py [--doc-qa 3] [--chat 3] [--new-tokens 64] [--ks 1,2,4,8]
    python benchmarks/speculative.py --quick --model PATH   # 1 + 1 prompts, 8 tokens, seconds

One run (kvlab.experiments.speculative): at batch 1 on doc-QA (answers quote a ~1,700-
token document) and chat prompts, kvlab without speculation, with n-gram drafting at
each k and with its self-speculative "layers" draft, and HF `generate`, plain and with
`prompt_lookup_num_tokens=k`, and (where `make peers` built .venv-vllm) vLLM plain and
with its n-gram speculative decoding at each k (eager at block size 32, named "vllm
(eager, block 32)"; its stats logging off in the timed runs, its drafts counted in an
untimed pass); then n-gram at k=4 against none at growing batch sizes (kvlab alone,
prompts cached). Every system is timed alike at batch 1: each prompt prefilled inside
its time from an empty prefix cache, after an untimed warm-up, so the wall speed-ups
compare across systems (decode speed-ups leave the prefill out; vLLM has none).
Prints JSON: per run, output tokens per target forward, acceptance, decode and wall
tok/s, speed-up over the same system without speculation, and whether the greedy tokens
equal that run's ("mismatches" lists any that do not: there must be none).
"""

from __future__ import annotations

import sys

from kvlab.experiments import speculative
from kvlab.experiments.scripts import load, machine, report, script_parser
from kvlab.peers.vllm_peer import vllm_missing


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--doc-qa", type=int, help="doc-QA prompts: default 3 (--quick: 1)")
    parser.add_argument("--chat", type=int, help="chat prompts: default 3 (--quick: 1)")
    parser.add_argument("--new-tokens", type=int, help="answer cap: default 64 (--quick: 8)")
    parser.add_argument("--ks", help="n-gram k values: default 1,2,4,8 (--quick: 2)")
    parser.add_argument("--batch-sizes", help="sweep: default 1,4,16 (--quick: 1,2)")
    parser.add_argument("--no-hf", action="store_true", help="skip HF's prompt lookup")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's n-gram drafting "
                        "(run where `make peers` built .venv-vllm)")  # fmt: skip
    args = parser.parse_args(argv)
    model = load(args)
    quick = args.quick
    ks = tuple(int(k) for k in (args.ks or ("2" if quick else "1,2,4,8")).split(","))
    sizes = tuple(int(b) for b in (args.batch_sizes or ("1,2" if quick else "1,4,16")).split(","))
    workloads = speculative.spec_workloads(
        model,
        args.doc_qa or (1 if quick else 3),
        args.chat or (1 if quick else 3),
        args.new_tokens or (8 if quick else 64),
        max_prompt_tokens=600 if quick else None,
    )
    result = speculative.compare_speculation(
        model,
        workloads,
        ks,
        layers_k=1 if quick else speculative.LAYERS_K,
        hf=not args.no_hf,
        vllm=not args.no_vllm and vllm_missing() is None,
        sweep_batch_sizes=sizes,
        sweep_k=ks[-1] if quick else 4,
    )
    out = {"machine": machine(model), "model": model.name, **result.to_json()}
    if out["mismatches"]:
        print(f"GREEDY TOKENS DIFFER FROM NO SPECULATION: {out['mismatches']}", file=sys.stderr)
    return report(out, args.out)


if __name__ == "__main__":
    main()
