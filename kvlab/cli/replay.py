"""`kvlab replay`: a workload against any OpenAI-compatible server, with its /metrics
(kvlab.serve.replay); --html writes its figure (kvlab.viz.endpoint) as a report."""

from __future__ import annotations

import argparse
import json

from kvlab.cli.shared import load_workload, print_endpoint, replay, split

HELP = "a workload against any OpenAI-compatible server, with its /metrics"


def add_arguments(rep: argparse.ArgumentParser) -> None:
    rep.add_argument(
        "--endpoint",
        required=True,
        metavar="URL[,URL...]",
        help="e.g. http://host:8000; several (comma-separated) run one after another",
    )
    rep.add_argument(
        "--endpoint-model", default=None, help="the model name it serves (default: its first)"
    )
    rep.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer dir or hub id of the served model (default: the embedded model)",
    )
    rep.add_argument("--workload", default="doc-qa", help="a built-in workload or a .jsonl file")
    rep.add_argument("--n", type=int, default=None, help="requests (built-in workloads)")
    rep.add_argument("--seed", type=int, default=None, help="seed (built-in workloads)")
    rep.add_argument("--stop-at-eos", action="store_true", help="default: exact token counts")
    rep.add_argument("--json", action="store_true", help="print a JSON list, a row per server")
    rep.add_argument("--html", default=None, metavar="PATH", help="write a plotly report")


def run(args: argparse.Namespace) -> int:
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from kvlab.model.loading import _embedded_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or _embedded_checkpoint(False))
    model, requests = SimpleNamespace(tokenizer=tokenizer), load_workload(args)
    results = {url: replay(args, url, model, requests) for url in split(args.endpoint)}
    rows = [result.summary() for result in results.values()]
    if args.html:
        import pandas as pd

        from kvlab.viz.endpoint import endpoint_figure
        from kvlab.viz.report import write_report

        table = pd.DataFrame(rows).set_index("endpoint")
        note = f"{len(requests)} requests; latencies on the client's clock"
        figures = {"live /metrics and latencies": endpoint_figure(results)}
        write_report(args.html, f"kvlab replay: {args.workload}", note, {"servers": table}, figures)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            print_endpoint(row)
    return 0
