"""Notebook 12's figures: KV per rank under tensor parallelism, latency colocated vs
disaggregated."""

from __future__ import annotations

import plotly.graph_objects as go


def kv_per_rank_figure(rows: dict[int, dict], kv_heads: int) -> go.Figure:
    """Bars of KV bytes per token on each rank against tensor_parallel_size (rows from
    kvlab.experiments.tensor_parallel.run_tp), marking where KV heads start replicating."""
    sizes = list(rows)
    figure = go.Figure(
        go.Bar(
            x=[f"tp={tp}" for tp in sizes],
            y=[rows[tp]["kv_bytes_per_token_per_rank"] for tp in sizes],
            text=[f"{rows[tp]['kv_heads_per_rank']} KV head(s)" for tp in sizes],
            textposition="outside",
        )
    )
    figure.update_layout(
        title=f"KV bytes per token on each rank ({kv_heads} KV heads, replicated past "
        f"tp={kv_heads})",
        yaxis_title="bytes per token per rank",
        height=380,
    )
    return figure


def latency_figure(setups: dict[str, dict]) -> go.Figure:
    """Grouped bars: TTFT p50 and ITL p50/p99 per setup (rows from
    kvlab.experiments.disagg.colocated_vs_disaggregated)."""
    names = list(setups)
    figure = go.Figure(
        [
            go.Bar(name=label, x=names, y=[setups[n][metric][p] * 1e3 for n in names])
            for label, metric, p in (
                ("TTFT p50", "ttft_s", "p50"),
                ("ITL p50", "itl_s", "p50"),
                ("ITL p99", "itl_s", "p99"),
            )
        ]
    )
    figure.update_layout(barmode="group", yaxis_title="ms", height=380,
                         title="Long prompts among running decodes")  # fmt: skip
    return figure


def pool_figure(setups: dict[str, dict]) -> go.Figure:
    """Grouped bars per decode engine of each disaggregated setup: requests routed to it,
    the most sequences it held running, and its mean decode batch (rows from
    kvlab.experiments.disagg.colocated_vs_disaggregated with a pool size in decode_engines)."""
    engines = [(name, d) for name, row in setups.items() for d in range(len(row.get("routed", [])))]
    labels = [f"{name.removeprefix('disaggregated').strip() or '1P:1D'} · engine {d}"
              for name, d in engines]  # fmt: skip
    figure = go.Figure(
        [
            go.Bar(name=label, x=labels, y=[setups[name][key][d] for name, d in engines])
            for label, key in (
                ("requests routed", "routed"),
                ("peak running", "peak_running"),
                ("mean decode batch", "mean_decode_batch"),
            )
        ]
    )
    figure.update_layout(barmode="group", yaxis_title="sequences", height=360,
                         title="Each decode engine's share of the requests")  # fmt: skip
    return figure
