"""A new variant is one file: a codec and a prefix index defined here, in the test file
alone, run through the Engine, `kvlab compare`'s config names and the planner."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvlab
from kvlab.build import check_config
from kvlab.cache import PREFIX_INDEXES
from kvlab.cache.codecs import CODECS, TokenCodec
from kvlab.cache.prefix import PrefixIndex, PrefixMatch
from kvlab.experiments.compare import compare
from kvlab.planner import ModelShape, kv_bytes_per_token, kv_formats
from kvlab.presets import parse_config
from kvlab.workloads import Request


class HalfCodec(TokenCodec):
    """K/V as fp16 with no checks: the smallest codec one can write."""

    describe = "fp16, written in a test"

    @classmethod
    def fields(cls, spec, dtype):
        return [((spec.num_kv_heads, spec.head_dim), torch.float16)]

    def encode(self, x):
        return (x.to(torch.float16),)

    def decode(self, fields):
        return fields[0].to(self.dtype)


class TupleIndex(PrefixIndex):
    """Full blocks keyed by (salt, every token up to the block's end): a plain dict."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.block_of: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}

    def _keys(self, tokens, salt):
        bs = self.block_size
        return [(salt, tuple(tokens[: end + bs])) for end in range(0, len(tokens) - bs + 1, bs)]

    def match(self, tokens, salt):
        blocks = []
        for key in self._keys(tokens, salt):
            if key not in self.block_of:
                break
            blocks.append(self.block_of[key])
        return PrefixMatch(blocks)

    def insert(self, tokens, blocks, salt, partial=False):
        for key, block in zip(self._keys(tokens, salt), blocks):
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key], self.key_of[block] = block, key

    def remove(self, block):
        del self.block_of[self.key_of.pop(block)]
        return []

    def __contains__(self, block):
        return block in self.key_of


@pytest.fixture
def registered():
    CODECS.register("half_test")(HalfCodec)
    PREFIX_INDEXES.register("tuple_test")(TupleIndex)
    yield
    CODECS.unregister("half_test")
    PREFIX_INDEXES.unregister("tuple_test")


def test_a_new_codec_and_index_run_through_engine_compare_and_planner(registered, tiny_model):
    preamble = [7 + (3 * j) % 500 for j in range(40)]
    prompts = [preamble + [900 + i, 901 + i] for i in range(4)]
    params = kvlab.SamplingParams(max_new_tokens=6, ignore_eos=True)

    config = dict(cache="paged", max_model_len=128, kv_budget_tokens=1024)
    plain = kvlab.Engine(tiny_model, kvlab.EngineConfig(**config, kv_codec="fp16"))
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    ours = kvlab.EngineConfig(**config, kv_codec="half_test", prefix_caching="tuple_test")
    engine = kvlab.Engine(tiny_model, ours)
    outputs = [engine.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in outputs] == expected  # fp16 storage, same as the fp16 codec
    assert [o.metrics.prefix_hit_tokens for o in outputs] == [0, 32, 32, 32]

    assert parse_config("paged+tuple_test+half_test").kv_codec == "half_test"
    requests = [Request(p, 6) for p in prompts]
    result = compare(tiny_model, requests, ["paged", "paged+tuple_test+half_test"])
    ours, plain = result.runs["paged+tuple_test+half_test"], result.runs["paged"]
    assert ours.config.kv_codec == "half_test" and ours.outputs == plain.outputs

    shape = ModelShape.from_config("Llama-3-8B")
    assert "half_test" in kv_formats()
    assert kv_bytes_per_token(shape, "half_test") == kv_bytes_per_token(shape, "fp16")


def test_unknown_names_list_what_is_registered():
    with pytest.raises(ValueError, match=r"prefix_caching='lru' is unknown; choose one of .*radix"):
        check_config(kvlab.EngineConfig(cache="paged", prefix_caching="lru"))
    with pytest.raises(ValueError, match="unknown option 'int3'"):
        parse_config("paged+int3")


def test_importing_the_kernels_loads_only_torch_and_triton():
    """(torch itself imports tqdm, so that one is not checked.)"""
    code = (
        "import sys, kvlab.kernels; "
        "loaded = set(sys.modules) | {m.split('.')[0] for m in sys.modules}; "
        "print(sorted(loaded & {'pandas', 'transformers', 'plotly', 'ipywidgets', 'kvlab.engine'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


SHADOW_CHECK = """
import importlib.metadata, sys
try:
    importlib.metadata.version("kernels")
    installed = True
except importlib.metadata.PackageNotFoundError:
    installed = False
try:
    import kernels
    print("installed" if installed and not kernels.__file__.startswith(sys.argv[1]) else kernels)
except ImportError as error:
    print("none" if not installed and "kvlab.kernels" in str(error) else error)
import kvlab.kernels
assert hasattr(kvlab.kernels, "kv_write"), kvlab.kernels
"""


def test_the_kernels_folder_does_not_shadow_an_installed_kernels_package():
    """From the repository root (on sys.path for `python -c`), `import kernels` gives the
    installed `kernels` distribution transformers imports, not kvlab's folder; where none is
    installed, a plain ImportError."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", SHADOW_CHECK, str(root / "kernels")],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() in {"installed", "none"}, out.stdout
