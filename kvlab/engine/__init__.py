"""The engine: requests in, tokens out.

engine.py     Engine: add_request, step, generate, run, cancel
scheduler.py  which sequences run each step; admission, preemption, swapping
sequence.py   one request's tokens, state and timings
sampler.py    greedy, temperature, top-k, top-p
outputs.py    what a finished request hands back
telemetry.py  one row per step
"""
