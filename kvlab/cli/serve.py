"""`kvlab serve`: an OpenAI-compatible HTTP server with vLLM's /metrics over one engine
(kvlab.serve)."""

from __future__ import annotations

import argparse

HELP = "an OpenAI-compatible HTTP server with vLLM's /metrics over one engine"


def add_arguments(srv: argparse.ArgumentParser) -> None:
    srv.add_argument("--model", default=None, help="HF hub id or local dir (default: embedded)")
    srv.add_argument(
        "--config",
        default=None,
        help="a config name (as for compare; default paged+prefix) or a JSON object of "
        'EngineConfig fields, e.g. \'{"cache": "paged", "admission": "watermark"}\'',
    )
    srv.add_argument("--budget", default=None, help="KV budget: bytes (1GiB) or tokens (8192tok)")
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="default: the model's name")
    srv.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    srv.add_argument("--api-key", default=None, help="require this Bearer key (vLLM's flag)")
    srv.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help='a JSON object {"key": "tenant", ...}: each tenant its own prefix cache',
    )
    srv.add_argument(
        "--admin-api-key",
        default=None,
        help="the key of the admin routes (/reset_prefix_cache); with tenant keys and "
        "without it, nobody may flush the prefix cache",
    )
    srv.add_argument("--max-request-bytes", type=int, default=1 << 20, help="413 past it")
    srv.add_argument(
        "--tenant-max-running", type=int, default=None, help="a tenant's requests in the engine"
    )
    srv.add_argument(
        "--tenant-max-queued", type=int, default=None, help="a tenant's waiting ones (429 past)"
    )
    srv.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="vLLM's flag: publish KV events over ZMQ, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\' (kvlab.serve.kv_events; '
        "needs prefix_caching='hash'; with prefix_caching_hash_algo='sha256_cbor' the block "
        "hashes are vLLM's)",
    )


def run(args: argparse.Namespace) -> int:
    import logging

    import kvlab
    from kvlab.presets import model_bytes_per_token, parse_budget
    from kvlab.serve import Server, engine_config
    from kvlab.serve.kv_events import KVEventsConfig, kv_events_publisher
    from kvlab.serve.limits import ServeLimits
    from kvlab.serve.tenants import Tenants

    if args.kv_events_config:  # a bad flag fails before the model loads
        KVEventsConfig.from_json(args.kv_events_config)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    base = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    engine_config(args.config, **base)  # a bad config fails before the model loads
    tenants = Tenants.from_flags(args.api_key, args.api_keys_file, args.admin_api_key)  # these too
    limits = ServeLimits(
        max_request_bytes=args.max_request_bytes,
        tenant_max_running=args.tenant_max_running,
        tenant_max_queued=args.tenant_max_queued,
    )
    model = kvlab.load_model(args.model, device=args.device, progress=False)
    if args.budget:
        base["kv_budget_bytes"] = parse_budget(args.budget, model_bytes_per_token(model))
    publisher = kv_events_publisher(args.kv_events_config)
    try:
        engine = kvlab.Engine(model, engine_config(args.config, **base), kv_events=publisher)
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    server = Server(engine, args.served_model_name, tenants, limits, publisher)
    server.log_startup()
    server.run(args.host, args.port, args.log_level)
    return 0
