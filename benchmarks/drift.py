"""Greedy drift: the same prompts alone and batched, chunked, warm or on one thread.

    python benchmarks/drift.py [--prompts 16] [--new-tokens 32] [--kv-codec int8] [--out F]
    python benchmarks/drift.py --quick --model PATH   # 2 prompts, 4 tokens, seconds

Each prompt (the chat prompts, through the chat template) runs alone on `--threads`
(default 2), then in each setting (kvlab.experiments.determinism): in a batch of 16, its
prompt in chunks of 16 tokens, from a warm prefix cache, alone on the other thread count
(1 for 2, 2 for 1); in the default mode and with
EngineConfig(batch_invariant=True), on the torch and the kernels attention. Prints JSON:
per mode and setting, how many prompts' answers part from their answer alone and how
many steps' logits are not the same bits; per parting prompt, the token where it parts,
what was chosen before and after, and the alone run's logit gap between the two.
"""

from __future__ import annotations

from kvlab import texts
from kvlab.experiments.determinism import Setting, drift
from kvlab.experiments.scripts import load, machine, report, script_parser
from kvlab.model.prompts import encode_prompt

CHUNKED = {"chunked_prefill": True, "max_num_batched_tokens": 16}


def settings(threads: int) -> list[Setting]:
    """What differs from running alone on `threads` threads, one thing at a time."""
    return [
        Setting("batch of 16", batch=16),
        Setting("chunks of 16", CHUNKED),
        Setting("warm prefix", {"prefix_caching": "hash"}, warm=True),
        Setting("other thread count", threads=2 if threads == 1 else 1),
    ]


MODES = {  # name: engine overrides
    "default": {},
    "batch-invariant": {"batch_invariant": True},
    "kernels": {"attention": "kernels"},
    "kernels, batch-invariant": {"attention": "kernels", "batch_invariant": True},
}


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--prompts", type=int, help="chat prompts: default 16 (--quick: 2)")
    parser.add_argument("--new-tokens", type=int, help="per answer: default 32 (--quick: 4)")
    parser.add_argument("--kv-codec", help="how K/V are stored (e.g. int8); default fp32")
    parser.add_argument("--modes", help=f"comma-separated, of {list(MODES)}; default all")
    args = parser.parse_args(argv)
    args.threads = args.threads or 2  # the reference's; one setting runs on the other count
    model = load(args)
    count = args.prompts or (2 if args.quick else 16)
    new_tokens = args.new_tokens or (4 if args.quick else 32)
    prompts = [encode_prompt(model.tokenizer, p) for p in texts.chat_prompts()[:count]]
    companions = [encode_prompt(model.tokenizer, p) for p in texts.chat_prompts()[count:]]
    modes = args.modes.split(",") if args.modes else list(MODES)
    out = {
        "machine": machine(model),
        "model": model.name,
        "reference_threads": args.threads,
        "kv_codec": args.kv_codec,
        "prompts": count,
        "new_tokens": new_tokens,
        "modes": {},
    }
    for mode in modes:
        base = {**MODES[mode], "kv_codec": args.kv_codec}
        frame = drift(model, prompts, settings(args.threads), new_tokens, base, companions)
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
