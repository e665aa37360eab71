"""What sliding-window layers cost a model not trained with them: perplexity on held-out
text with Gemma 3's 5 local : 1 global pattern at several windows, and with every layer
sliding, against every layer full.

    python benchmarks/attention_pattern.py [--tokens 2048] [--windows 32,64,128,256] [--out F]
    python benchmarks/attention_pattern.py --quick --model PATH   # 64 tokens, seconds

The held-out prose (kvlab.texts.heldout, never in a prompt or a test) goes through the
runner in 128-token chunks (kvlab.experiments.pattern_quality). Prints JSON: per pattern,
the perplexity, its change against all-full with a 95% interval from the paired
per-token log losses, and how often the next-token argmax agrees with all-full's.
"""

from __future__ import annotations

from kvlab.experiments import quality
from kvlab.experiments.pattern_quality import pattern_quality
from kvlab.experiments.scripts import load, machine, report, script_parser, sized


def patterns(windows: list[int]) -> list[str]:
    """Gemma 3's 5 : 1 at every window, then every layer sliding at the smallest."""
    return [f"window={w}*5,full" for w in windows] + [f"window={min(windows)}"]


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--tokens", type=int, help="held-out tokens: default 2048 (--quick 64)")
    parser.add_argument("--windows", help="comma-separated: default 32,64,128,256 (--quick 8,512)")
    args = parser.parse_args(argv)
    sized(args, {"tokens": (2048, 64), "windows": ("32,64,128,256", "8,512")})
    model = load(args)
    ids = quality.heldout_ids(model, args.tokens)
    windows = [int(w) for w in args.windows.split(",")]
    frame = pattern_quality(model, ids, patterns(windows))
    out = {
        "machine": machine(model),
        "model": model.name,
        "tokens_scored": len(ids) - 1,
        "layers": model.config.num_hidden_layers,
        "patterns": frame.round(4).to_dict("records"),
    }
    return report(out, args.out)


if __name__ == "__main__":
    main()
