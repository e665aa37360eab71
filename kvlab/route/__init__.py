"""`kvlab route`: a cache-aware router in front of N OpenAI-compatible replicas.

    hashing.py    what a router hashes: vLLM's block hashes of a request's token ids
                  (precise), chained hashes of its characters (approximate, as llm-d)
    index.py      block hash -> replicas, kept from the replicas' KV events
    events.py     a ZMQ subscriber of vLLM-format KV events (kvlab serve, vllm serve)
    policies.py   round-robin, least-loaded, approx-prefix, precise (with a load guard)
    router.py     the backends, the policy in force, the decision log
    app.py        the HTTP front (FastAPI): OpenAI's routes streamed through, /router/*
    server.py     RouterThread (tests, notebooks) and run_router (the command)
    replicas.py   N `kvlab serve` processes publishing KV events, started and stopped
    sessions.py   multi-turn chats over HTTP through any endpoint, timed per turn

It talks to replicas over HTTP and reads their events over ZMQ; it never imports the
engine or the server (kvlab serve), so it routes to vLLM replicas the same way.
Design: docs/design/replicas.md. Needs the `serve` extra plus pyzmq, msgpack and cbor2.
"""
