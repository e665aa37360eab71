"""Notebook 14, many replicas: a fleet of engines behind real HTTP and a router reading
their KV events, the router's block index as a table and a figure, a live app of where
requests go and why, and the hit-rate / TTFT bars per policy.

    with ThreadFleet(model, 3, budget_tokens=1024) as fleet:   # 3 engines, 1 router
        app = RoutingApp(fleet.router)
        display(app.widget)
        turns = fleet.run(sessions, policy="precise", on_decision=app.add)

A `ThreadFleet` runs each replica as `kvlab serve` does (an engine, its loop thread,
uvicorn on a free loopback port) publishing KV events over ZMQ on free ports, all in this
process so a notebook starts it in seconds; the router is kvlab.route's, in a thread too,
subscribed to every replica. Everything stops when the block ends.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.config import EngineConfig
from kvlab.route.hashing import token_block_hashes
from kvlab.route.router import Backend, Router
from kvlab.route.server import RouterThread
from kvlab.route.sessions import run_chats, summary
from kvlab.serve import ServerThread
from kvlab.serve.kv_events import KVEventPublisher, KVEventsConfig
from kvlab.viz.app import current
from kvlab.viz.style import palette_color

REPLICA = EngineConfig(cache="paged", prefix_caching="hash", block_size=16,
                       prefix_caching_hash_algo="sha256_cbor")  # fmt: skip
POLICY_ORDER = ["round-robin", "least-loaded", "approx-prefix", "precise"]


class ThreadFleet:
    """`n` replicas of `model` (or one per entry of `configs`) with `budget_tokens` of KV
    each, and a router (`policy`) over them; `url` is the router's."""

    def __init__(
        self,
        model,
        n: int = 3,
        budget_tokens: int = 1024,
        configs: list[EngineConfig] | None = None,
        policy: str = "precise",
        **router_options,
    ):
        import kvlab

        base = [replace(c, kv_budget_tokens=c.kv_budget_tokens or budget_tokens)
                for c in (configs or [REPLICA] * n)]  # fmt: skip
        self.model, self.servers, self.publishers = model, [], []
        backends = []
        try:
            for i, config in enumerate(base):
                kv = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0",
                                    replay_endpoint="tcp://*:0")  # fmt: skip
                publisher = KVEventPublisher(kv)
                self.publishers.append(publisher)
                engine = kvlab.Engine(model, config, kv_events=publisher)
                self.servers.append(ServerThread(engine, kv_events=publisher).start())
                backends.append(Backend(self.servers[-1].url, publisher.endpoint,
                                        publisher.replay_endpoint, name=f"r{i}"))  # fmt: skip
            self.router = Router(backends, policy, tokenizer=model.tokenizer, **router_options)
            self.front = RouterThread(self.router).start()
        except BaseException:
            self.close()
            raise
        self.url = self.front.url

    def engines(self):
        return [s.server.engine for s in self.servers]

    def quiet(self) -> None:
        """Wait until the router has read every event the replicas sent."""
        self.router.subscriber.wait_quiet()

    def reset(self) -> None:
        """Cold caches on every replica (each reports AllBlocksCleared), counts zeroed."""
        for server in self.servers:
            assert server.loop.call(lambda e: e.cache.reset_prefix_cache()).result(30)
        deadline = time.monotonic() + 30
        while any(self.router.index.size(r.name) for r in self.router.replicas):
            if time.monotonic() > deadline:
                raise RuntimeError("the router's index did not clear")
            time.sleep(0.05)
        self.router.reset_counts()

    def run(self, sessions, policy: str = "precise", on_decision=None, **options) -> list:
        """Serve `sessions` through the router under `policy` from cold caches; the turns
        (kvlab.route.sessions). `on_decision(entry)` is called, on this thread, for each
        routing decision as it happens (a live figure)."""
        self.reset()
        self.router.set_policy(policy)
        if on_decision is None:
            return run_chats(self.url, self.model.name, sessions, **options)
        done: queue.Queue = queue.Queue()
        worker = threading.Thread(
            target=lambda: done.put(run_chats(self.url, self.model.name, sessions, **options))
        )
        worker.start()
        seen = 0
        while worker.is_alive() or seen < len(self.router.decisions):
            entries = list(self.router.decisions)[seen:]
            for entry in entries:
                on_decision(entry)
            seen += len(entries)
            worker.join(0.2)
        return done.get()

    def close(self) -> None:
        if getattr(self, "front", None) is not None:
            self.front.stop()
        for server in self.servers:
            server.stop()

    def __enter__(self) -> ThreadFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def compare_policies(fleet: ThreadFleet, sessions, policies=POLICY_ORDER, **options):
    """Each policy from cold caches on the same sessions: one summary row per policy
    (kvlab.route.sessions.summary) and every turn."""
    rows, turns = [], {}
    names = [r.name for r in fleet.router.replicas]
    for policy in policies:
        started = time.perf_counter()
        turns[policy] = fleet.run(sessions, policy, **options)
        rows.append(
            {"policy": policy, **summary(turns[policy], time.perf_counter() - started, names)}
        )
    return pd.DataFrame(rows).set_index("policy"), turns


def policy_bars(table: pd.DataFrame) -> go.Figure:
    """Prefix hit rate and TTFT p50 / p99 per policy, side by side."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("prefix hit rate", "time to first token"))
    colors = [palette_color(i) for i in range(len(table))]
    fig.add_trace(go.Bar(x=table.index, y=table["hit_rate"], marker_color=colors,
                         text=[f"{v:.0%}" for v in table["hit_rate"]], showlegend=False),
                  row=1, col=1)  # fmt: skip
    for column, name, opacity in (("ttft_p50_s", "p50", 1.0), ("ttft_p99_s", "p99", 0.45)):
        fig.add_trace(go.Bar(x=table.index, y=table[column] * 1000, name=name,
                             marker_color=colors, opacity=opacity), row=1, col=2)  # fmt: skip
    fig.update_yaxes(tickformat=".0%", range=[0, 1], row=1, col=1)
    fig.update_yaxes(title_text="ms (p50 solid, p99 pale)", row=1, col=2)
    fig.update_layout(title=f"The same chats, {len(table)} routing policies (cold caches each)",
                      barmode="group", height=400, width=950, showlegend=False)  # fmt: skip
    return fig


def index_table(router: Router, tokenizer, per_replica: int = 4) -> pd.DataFrame:
    """The router's block index as it stands: for each replica its first blocks (hash as
    the events carry it, parent, how many replicas hold it, the block's first words)."""
    rows = []
    for replica in router.replicas:
        held = router.index.blocks.get(replica.name, set())
        roots = [
            h for h in held if router.index.info.get(h) and router.index.info[h].parent is None
        ]
        children: dict[int, list[int]] = {}
        for block in held:
            if block in router.index.info:
                children.setdefault(router.index.info[block].parent, []).append(block)
        for h in sorted(roots)[:1]:
            chain, current = [h], h
            while current in children and len(chain) < per_replica:
                current = min(children[current])
                chain.append(current)
            for position, block in enumerate(chain):
                info = router.index.info[block]
                rows.append({
                    "replica": replica.name, "block": position, "hash": f"{block:016x}",
                    "parent": "-" if info.parent is None else f"{info.parent:016x}",
                    "held by": ",".join(sorted(router.index.holders.get(block, ()))),
                    "tokens": repr(tokenizer.decode(list(info.tokens))[:40]),
                })  # fmt: skip
    return pd.DataFrame(rows)


def index_figure(router: Router) -> go.Figure:
    """Blocks each replica holds, as its events say, split by how many replicas hold the
    same hash (one: only there; more: a shared prefix such as the system prompt)."""
    names = [r.name for r in router.replicas]
    fig = go.Figure()
    for sharers in range(1, len(names) + 1):
        holders = router.index.holders
        counts = [
            sum(1 for h in router.index.blocks.get(n, ()) if len(holders.get(h, ())) == sharers)
            for n in names
        ]
        label = "only on this replica" if sharers == 1 else f"on {sharers} replicas"
        fig.add_trace(go.Bar(x=names, y=counts, name=label,
                             marker_color=palette_color(sharers - 1)))  # fmt: skip
    fig.update_layout(
        barmode="stack", height=340, width=620, yaxis_title="blocks held",
        title="The router's block index: blocks per replica, from KV events",
    )  # fmt: skip
    return fig


class RoutingApp:
    """Where each request went and why: a timeline (request -> replica, one colour per
    user/session, the policy's reason on hover) that grows live as decisions are made,
    and, for the request the slider picks, the score of every replica (cached blocks for
    the prefix policies, requests in flight for least-loaded)."""

    def __init__(self, router: Router, width: int = 950):
        import ipywidgets as widgets

        self.names = [r.name for r in router.replicas]
        self.entries: list[dict] = []
        self.users: dict[str | None, int] = {}
        titles = ("where each request went", "why: the scores")
        fig = make_subplots(rows=1, cols=2, column_widths=[0.68, 0.32], subplot_titles=titles)
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                marker={"size": 11},
                hovertext=[],
                hoverinfo="text",
                name="requests",
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                name="picked",
                marker={"size": 20, "symbol": "circle-open", "color": "#222", "line": {"width": 2}},
            ),
            row=1,
            col=1,
        )
        fig.add_trace(go.Bar(x=self.names, y=[0] * len(self.names), name="score",
                             marker_color="#636efa"), row=1, col=2)  # fmt: skip
        fig.update_yaxes(categoryorder="array", categoryarray=self.names, row=1, col=1)
        fig.update_xaxes(title_text="request", row=1, col=1)
        fig.update_layout(height=380, width=width, showlegend=False, title="no request yet")
        self.figure = go.FigureWidget(fig)
        self.slider = widgets.IntSlider(0, min=0, max=0, description="request",
                                        continuous_update=False)  # fmt: skip
        self.slider.observe(lambda change: self.pick(change["new"]), names="value")
        self.widget = widgets.VBox([self.slider, self.figure])

    def add(self, entry: dict) -> None:
        """One more decision (kvlab.route.router's log entry); the newest is picked."""
        self.entries.append(entry)
        colour = self.users.setdefault(entry.get("user"), len(self.users))
        with self.figure.batch_update():
            dots = self.figure.data[0]
            dots.x = [*dots.x, len(self.entries) - 1]
            dots.y = [*dots.y, entry["replica"]]
            dots.marker.color = [*(dots.marker.color or ()), palette_color(colour)]
            dots.hovertext = [*dots.hovertext, f"{entry.get('user')}: {entry['reason']}"]
        self.slider.max = len(self.entries) - 1
        self.slider.value = len(self.entries) - 1  # redraws the scores through pick()
        if self.slider.value == 0:
            self.pick(0)

    def pick(self, i: int) -> None:
        if not self.entries:
            return
        entry = self.entries[i]
        scores = entry.get("scores") or {}
        with self.figure.batch_update():
            self.figure.data[1].x, self.figure.data[1].y = [i], [entry["replica"]]
            self.figure.data[2].y = [scores.get(n, 0) for n in self.names]
            self.figure.data[2].marker.color = [
                "#ef553b" if n == entry["replica"] else "#636efa" for n in self.names
            ]
            blocks = f" of {entry['blocks']} blocks" if entry.get("blocks") else ""
            self.figure.layout.title = (
                f"request {i} ({entry.get('user')}, {entry['policy']}) -> {entry['replica']}: "
                f"{entry['reason']}{blocks}"
            )
        # the figure grows while a front end may still be loading plotly, which misses
        # edits: its widget state carries the figure as it stands (kvlab.viz.app.current)
        current(self.figure)


def disagreement(fleet: ThreadFleet, prompt_ids: list[int]) -> pd.DataFrame:
    """The same prompt served by every replica directly, then looked up in the router's
    index with the router's block size and seed: what each replica reported, and what the
    router can find of it."""
    import httpx

    for server in fleet.servers:
        body = {"model": fleet.model.name, "prompt": prompt_ids, "max_tokens": 1}
        httpx.post(server.url + "/v1/completions", json=body, timeout=120).raise_for_status()
    fleet.quiet()
    policy = fleet.router.policy
    size = policy._block_size(fleet.router.replicas)
    hashes = token_block_hashes(prompt_ids, size, None, getattr(policy, "hash_seed", None))
    found = fleet.router.index.longest_prefix(hashes, [r.name for r in fleet.router.replicas])
    rows = []
    for server, replica in zip(fleet.servers, fleet.router.replicas):
        config = server.server.engine.config
        rows.append({
            "replica": replica.name,
            "block_size": config.block_size,
            "hash seed": config.prefix_caching_hash_seed or "vllm-none-hash",
            "blocks it reported": fleet.router.index.size(replica.name),
            "router's block size": size,
            "blocks the router finds": found[replica.name],
        })  # fmt: skip
    return pd.DataFrame(rows).set_index("replica")
