"""Shared fixtures: the embedded model is loaded once per test session (from the user cache)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from functools import cache
from pathlib import Path

import pytest
import torch

# Without CUDA, kvlab.kernels' Triton kernels run under Triton's interpreter, which is
# chosen when triton is first imported: before any test module imports kvlab.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvlab  # noqa: E402
from kvlab import texts  # noqa: E402

torch.manual_seed(0)

# `make test` runs on every core with pytest-xdist (-n auto --dist loadfile): a worker takes
# a whole test module or a whole notebook at a time (nbval runs a notebook's cells in order,
# in one kernel), and each notebook of the browser test is a unit of its own (see
# pytest_xdist_make_scheduler). Each worker computes on its share of the cores (one each on
# a 2-core machine), and so do the notebook kernels, vLLM engines and tensor-parallel ranks
# it starts (OMP_NUM_THREADS). What they start waits for work without spinning
# (OMP_WAIT_POLICY=PASSIVE): an OpenMP thread that spins while it waits takes the core the
# other worker computes on. Notebook 15, which runs one setting on two threads, took 189 s
# under nbclient beside a busy core with OpenMP's default, 48 s with PASSIVE (this machine,
# 2-core Intel Xeon); the wait policy changes no result, only who holds the cores.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    SHARE = max(1, (os.cpu_count() or 1) // WORKERS)
    torch.set_num_threads(SHARE)
    os.environ["OMP_NUM_THREADS"] = str(SHARE)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BROWSER_TEST = "tests/test_browser.py"
CHROMIUM = os.environ.get("KVLAB_CHROMIUM", "/usr/lib/chromium/chromium")
# The longest units of work go first, so that no worker is left with one of them at the
# end: the browser test's notebooks, every notebook under nbval (each group slowest first,
# by the wall times `make notebook-times` saved), then these modules (pytest --durations).
LONG_MODULES = (
    "test_nbgrader_venv.py",
    "test_serve_vllm_client.py",
    "test_spec_vllm.py",
    "test_vllm_oracle.py",
    "test_vllm_kv_events.py",
    "test_vllm_block_hash.py",
    "test_engine_fuzz.py",
    "test_scheduler.py",
    "test_vllm_bench.py",
    "test_labs.py",
    "test_benchmarks.py",
    "test_tensor_parallel.py",
    "test_wheel.py",
)
# notebook_times.<machine class>.json: one per class of machine (benchmarks/results/)
RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"


def _notebook_seconds() -> dict[str, float]:
    """Each notebook's saved wall time by file name, the longest over every machine class
    (empty where none is saved)."""
    seconds: dict[str, float] = {}
    for path in sorted(RESULTS.glob("notebook_times.*.json")):
        try:
            rows = json.loads(path.read_text())["notebooks"]
        except (OSError, ValueError, KeyError):
            continue
        for row in rows:
            name = Path(row["notebook"]).name
            seconds[name] = max(seconds.get(name, 0.0), float(row["wall_s"]))
    return seconds


def browser_can_run() -> bool:
    """Whether tests/test_browser.py can run here: Debian's chromium and playwright."""
    return Path(CHROMIUM).exists() and importlib.util.find_spec("playwright") is not None


def _run_once(config, items) -> None:
    """A notebook the browser test runs is not run by nbval again.

    The browser test's Run All is checked with nbval's own comparison (tests/nbval_check.py),
    so nbval's items for that notebook would only execute it a second time. Where the
    browser test cannot run, or is not selected, nbval runs the notebook as usual.
    """
    if not browser_can_run():
        return
    in_browser = {
        item.callspec.params["name"]
        for item in items
        if item.nodeid.startswith(BROWSER_TEST + "::")
    }
    notebooks = Path(__file__).parents[1] / "notebooks"
    twice = {
        item
        for item in items
        if item.path.suffix == ".ipynb"
        and item.path.parent == notebooks
        and item.path.name in in_browser
    }
    if twice:
        config.hook.pytest_deselected(items=[item for item in items if item in twice])
        items[:] = [item for item in items if item not in twice]


# `make test-fast` (KVLAB_TEST_TIER=fast): the inner loop, under 3 minutes. No servers, no
# vLLM, no browser, no notebooks, no wheel or docs build, no process faults; tests of the
# tiny model run, and of the real model only those marked `smoke`.
FAST_TIER = os.environ.get("KVLAB_TEST_TIER") == "fast"
NOT_FAST = (
    "test_browser.py", "test_docs.py", "test_wheel.py", "test_nbgrader_venv.py",
    "test_labs_nbgrader.py", "test_engine_fuzz.py", "test_process_faults.py",
    "test_tensor_parallel.py", "test_disagg.py", "test_route.py", "test_benchmarks.py",
)  # fmt: skip
NOT_FAST_PREFIXES = ("test_serve", "test_vllm", "test_spec_vllm")


def _fast(item) -> bool:
    """Whether an item belongs to the fast tier."""
    name = item.path.name
    if item.path.suffix == ".ipynb" or name in NOT_FAST or name.startswith(NOT_FAST_PREFIXES):
        return False
    return "model" not in getattr(item, "fixturenames", ()) or bool(
        item.get_closest_marker("smoke")
    )


def _keep_fast(config, items) -> None:
    slow = [item for item in items if not _fast(item)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if _fast(item)]


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs
def pytest_collection_modifyitems(config, items):
    """Each notebook run once, and the long units of work first (xdist hands them out in
    collection order); only the fast tier under `make test-fast`."""
    if FAST_TIER:
        _keep_fast(config, items)
    _run_once(config, items)
    seconds = _notebook_seconds()

    def rank(item) -> tuple[int, float]:
        if item.nodeid.startswith(BROWSER_TEST + "::"):
            return 0, -seconds.get(item.callspec.params.get("name", ""), 0.0)
        if item.path.suffix == ".ipynb":
            return 1, -seconds.get(item.path.name, 0.0)
        return (2 if item.path.name in LONG_MODULES else 3), 0.0

    items.sort(key=rank)  # stable: a file's tests stay together, in order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, except that each notebook of the browser test is a unit of its own.

    The browser test is one file holding every notebook (each its own JupyterLab page and
    kernel); as one unit it would keep one worker busy for as long as the rest of the suite
    takes on the other. Other modes are left to xdist.
    """
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class NotebookScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(BROWSER_TEST + "::"):
                return nodeid
            return super()._split_scope(nodeid)

    return NotebookScheduling(config, log)


# `make test` sets KVLAB_REQUIRE_DEV=1. There a `pytest.importorskip` of a package kvlab's
# set-up installs (pyproject.toml: its dependencies and the `dev` extra) fails the test
# instead of skipping it: the package missing means a broken install, not an optional part.
# Genuinely optional things still skip: a GPU, vLLM's venv, chromium, nbgrader (the
# `grading` extra), and any importorskip given a reason= of its own.
REQUIRE_DEV = "KVLAB_REQUIRE_DEV"
PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"
IMPORT_NAMES = {"pyzmq": "zmq", "pytest_xdist": "xdist", "import_linter": "importlinter"}
IMPORTORSKIP = re.compile(r"could not import '([\w.]+)'")  # importorskip's own reason


@cache
def required_imports() -> frozenset[str]:
    """Top-level import names of kvlab's dependencies and of its `dev` extra."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: kvlab's installed metadata lists the same
        from importlib.metadata import requires

        specs = [r for r in requires("kvlab") or () if "extra" not in r or '"dev"' in r]
    else:
        project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
        specs = project["dependencies"] + project["optional-dependencies"]["dev"]
    dists = {re.match(r"[\w.-]+", spec).group(0).lower().replace("-", "_") for spec in specs}
    return frozenset(IMPORT_NAMES.get(name, name) for name in dists)


def fail_a_skipped_requirement(report) -> None:
    """Under KVLAB_REQUIRE_DEV=1, turn `report`, if it is importorskip's skip of a package
    kvlab requires, into a failure."""
    if os.environ.get(REQUIRE_DEV) != "1" or not report.skipped:
        return
    if not isinstance(report.longrepr, tuple):  # (path, line, "Skipped: <reason>")
        return
    reason = report.longrepr[2]
    found = IMPORTORSKIP.search(reason)
    if found and found.group(1).partition(".")[0] in required_imports():
        report.outcome = "failed"
        report.longrepr = (
            f"{REQUIRE_DEV}=1 and a package kvlab's set-up installs (pyproject.toml) cannot "
            f"be imported: the install is broken, so this fails instead of skipping.\n{reason}"
        )


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield  # a module-level importorskip skips the whole module here
    fail_a_skipped_requirement(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield  # an importorskip inside a test or a fixture
    fail_a_skipped_requirement(report)
    return report


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """Every test leaves torch's thread count as it found it. A test that sets it (a
    benchmark script's --threads run in-process, a kernel test on two threads) would
    otherwise leave its xdist worker on two threads for the rest of the session, and on a
    2-core machine every later test there fights the other worker for both cores (OpenMP
    threads spinning against each other: test_scheduler took 184 s instead of 37 s)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def model() -> kvlab.LoadedModel:
    return kvlab.load_model(device="cpu", progress=False)


@pytest.fixture(scope="session")
def chat_prompts() -> list[str]:
    return texts.chat_prompts()


def small_engine(model, **overrides) -> kvlab.Engine:
    """An engine with a short max_model_len so naive reservations stay small."""
    config = dict(max_model_len=512, kv_budget_tokens=4 * 512)
    config.update(overrides)
    return kvlab.Engine(model, kvlab.EngineConfig(**config))


def hf_greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """HF transformers `generate`, greedy, one prompt: the reference kvlab must match."""
    ids = torch.tensor([prompt_ids])
    out = model.hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=model.tokenizer.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, model) -> Path:
    """The directory of the tiny model (`tiny_model`): a checkpoint `load_model` reads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        vocab_size=model.tokenizer.vocab_size,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    model.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path) -> kvlab.LoadedModel:
    """A 2-layer random Llama with the embedded tokenizer: fast enough for property tests.

    Its weights are drawn wide (initializer_range=0.3, not HF's 0.02), so it attends
    sharply and its greedy tokens depend on every K/V it reads: an engine that restores
    zeros or reads a wrong slot changes its outputs (tests/test_mutations.py checks it).
    """
    return kvlab.load_model(tiny_model_path, device="cpu", progress=False)


WINDOW = 8  # tiny_qwen's sliding window


def as_qwen2(llama, layer_types: list[str], window: int):
    """The Llama `llama` (a transformers model) as a Qwen2 with these layer kinds: the same
    weights, zero Q/K/V biases, so its forward is the Llama's with sliding-window masks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = llama.config
    config = Qwen2Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings,
        use_sliding_window=True, sliding_window=window, max_window_layers=0,
        layer_types=layer_types, torch_dtype=c.torch_dtype,
    )  # fmt: skip
    qwen = Qwen2ForCausalLM(config).to(llama.dtype).eval()
    missing, unexpected = qwen.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all(name.endswith(".bias") for name in missing), missing
    for layer in qwen.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.zeros_(proj.bias)
    return qwen


def gemma3_reference(model: kvlab.LoadedModel, window: int) -> kvlab.LoadedModel:
    """`model` as transformers runs it with Gemma 3's 5 sliding (`window` tokens) : 1 full
    pattern (`attention_pattern=f"window={window}*5,full"`)."""
    layers = model.config.num_hidden_layers
    kinds = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    qwen = as_qwen2(model.hf_model, kinds, window)
    return kvlab.LoadedModel(qwen, model.tokenizer, f"{model.name}-as-qwen2", 0.0)


@pytest.fixture(scope="session")
def tiny_qwen(tiny_model, tmp_path_factory) -> kvlab.LoadedModel:
    """The tiny Llama as a Qwen2 whose first layer slides (WINDOW tokens), second is full."""
    qwen = as_qwen2(tiny_model.hf_model, ["sliding_attention", "full_attention"], WINDOW)
    path = tmp_path_factory.mktemp("tiny-qwen2-sliding")
    qwen.save_pretrained(path)
    tiny_model.tokenizer.save_pretrained(path)
    return kvlab.load_model(path, device="cpu", progress=False)
