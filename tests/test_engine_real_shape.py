"""Greedy decoding and logprobs on a SmolLM2-135M-shaped model (Llama architecture, real shapes)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import bench_cache_dir, make_model
from test_engine import assert_matches_hf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir():
    # built once per machine (the benchmarks' cache, as test_bf16 does): ~9 s of CPU a build
    return make_model("smollm2-135m", bench_cache_dir() / "smollm2-135m")


def test_greedy_and_logprobs_match_transformers(model_dir):
    cfg = Config()
    cfg.model.name = str(model_dir)
    cfg.model.max_model_len = 256
    cfg.engine.kv_cache_bytes = 64 << 20
    engine = Engine(cfg)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [engine.tokenizer.encode("The capital of France is"), [11, 2000, 40000, 7, 123, 999], [42]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))
    assert_matches_hf(hf, prompts, outs)


ALLOCATOR_PROBE = """
import ctypes, sys
fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in fields]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "engine":
    from rlserve.config.schema import Config
    from rlserve.engine.engine import Engine
    cfg = Config()
    cfg.model.max_model_len = 64
    cfg.engine.kv_cache_bytes = 4 << 20
    Engine(cfg)
mapped = libc.mallinfo2().hblkhd
buf = libc.malloc(16 << 20)  # the size of a step's packing buffers
print(libc.mallinfo2().hblkhd - mapped)
libc.free(buf)
print(libc.mallinfo2().fordblks)
"""


def allocator_after(mode: str) -> tuple[int, int]:
    """(bytes a 16 MiB malloc mapped outside the heap, free bytes kept in the heap after freeing it)."""
    out = subprocess.run([sys.executable, "-c", ALLOCATOR_PROBE, mode], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    mapped, kept = out.stdout.split()[-2:]
    return int(mapped), int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tunes glibc malloc")
def test_engine_keeps_freed_step_buffers_mapped():
    # glibc's default serves a 16 MiB block with its own mmap and unmaps it on free, so every step
    # faults its buffers in again; an engine on CPU moves them onto the heap and keeps them there
    mapped, _ = allocator_after("plain")
    assert mapped >= 16 << 20
    mapped, kept = allocator_after("engine")
    assert mapped == 0
    assert kept >= 16 << 20
