"""Greedy drift: the same prompts alone and batched, chunked, warm or on one thread.

    python benchmarks/drift.py [--prompts 16] [--new-tokens 32] [--kv-codec int8] [--out F]
    python benchmarks/drift.py --workload doc-qa --prompts 4 --batch 4 --chunk 64
    python benchmarks/drift.py --quick --model PATH   # 2 prompts, 4 tokens, seconds

Each prompt (the chat prompts through the chat template, or with `--workload doc-qa`
doc-QA's) runs alone on `--threads` (default 2), then in each setting
(kvlab.experiments.determinism): in a batch of `--batch` (16), its prompt in chunks of
`--chunk` (16) tokens, from a warm prefix cache, alone on the other thread count (1 for
2, 2 for 1); in the default mode and with
EngineConfig(batch_invariant=True), on the torch and the kernels attention. Prints JSON:
per mode and setting, how many prompts' answers part from their answer alone and how
many steps' logits are not the same bits; per parting prompt, the token where it parts,
what was chosen before and after, and the alone run's logit gap between the two.
"""

from __future__ import annotations

from kvlab import texts, workloads
from kvlab.experiments.determinism import Setting, drift
from kvlab.experiments.scripts import load, machine, report, script_parser
from kvlab.model.prompts import encode_prompt
from kvlab.workloads import encode_requests

DOC_QA_SEED = 2387  # doc-QA prompts among the shortest (457-576 tokens), as notebook 07
MODES = {  # name: engine overrides
    "default": {},
    "invariant": {"batch_invariant": True},
    "kernels": {"attention": "kernels"},
    "kernels+invariant": {"attention": "kernels", "batch_invariant": True},
}


def settings(threads: int, batch: int, chunk: int) -> list[Setting]:
    """What differs from running alone on `threads` threads, one thing at a time."""
    return [
        Setting(f"batch of {batch}", batch=batch),
        Setting(f"chunks of {chunk}", {"chunked_prefill": True, "max_num_batched_tokens": chunk}),
        Setting("warm prefix", {"prefix_caching": "hash"}, warm=True),
        Setting("other thread count", threads=2 if threads == 1 else 1),
    ]


def prompts_of(model, workload: str, count: int) -> list[list[int]]:
    """Token ids of `count` prompts: the chat prompts through the chat template, or
    doc-QA's (a shared ~300-token preamble, a document, a question)."""
    if workload == "chat":
        return [encode_prompt(model.tokenizer, p) for p in texts.chat_prompts()[:count]]
    requests = encode_requests(model, workloads.doc_qa(count, DOC_QA_SEED))
    return [list(r.prompt) for r in requests]


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--workload", choices=("chat", "doc-qa"), default="chat")
    parser.add_argument("--prompts", type=int, help="compared: default 16 (--quick: 2)")
    parser.add_argument("--batch", type=int, default=16, help="requests per batch (16)")
    parser.add_argument("--chunk", type=int, default=16, help="chunked prefill's step (16)")
    parser.add_argument("--new-tokens", type=int, help="per answer: default 32 (--quick: 4)")
    parser.add_argument("--kv-codec", help="how K/V are stored (e.g. int8); default fp32")
    parser.add_argument("--modes", help=f"comma-separated, of {list(MODES)}; default all")
    args = parser.parse_args(argv)
    args.threads = args.threads or 2  # the reference's; one setting runs on the other count
    model = load(args)
    count = args.prompts or (2 if args.quick else 16)
    new_tokens = args.new_tokens or (4 if args.quick else 32)
    every = prompts_of(model, args.workload, max(count, args.batch))
    prompts, companions = every[:count], every[count:]  # companions fill a batch
    modes = args.modes.split(",") if args.modes else list(MODES)
    out = {
        "machine": machine(model),
        "model": model.name,
        "workload": args.workload,
        "reference_threads": args.threads,
        "kv_codec": args.kv_codec,
        "prompts": count,
        "new_tokens": new_tokens,
        "modes": {},
    }
    for mode in modes:
        base = {**MODES[mode], "kv_codec": args.kv_codec}
        changes = settings(args.threads, args.batch, args.chunk)
        frame = drift(model, prompts, changes, new_tokens, base, companions)
        summary = {}
        for name, rows in frame.groupby("setting", sort=False):
            parted = rows[rows["parts_at"].notna()]
            summary[name] = {
                "answers_parted": len(parted),
                "steps_not_bit_exact": int((rows["steps"] - rows["bit_exact"]).sum()),
                "steps": int(rows["steps"].sum()),
                "max_logit_change": float(rows["max_change"].max()),
                "partings": parted.drop(columns="setting").to_dict("records"),
            }
        out["modes"][mode] = summary
    return report(out, args.out)


if __name__ == "__main__":
    main()
