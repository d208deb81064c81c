"""Tensor parallelism (parallel.tp = 2) on CPU over gloo: the same tokens as one rank, logprobs as
transformers', weight updates, trainer pushes and LoRA on every rank, and a dead rank failing the
engine loudly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import start_server, stop_server
from rlserve.config.schema import Config
from rlserve.model.make import make_model
from test_engine_process import HANG_GUARD_S, children, gone, wait_until
from test_server_rl import ADMIN, PROMPTS, generate, hf_check, trainer_push

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for child processes")
TP2 = ("--parallel.tp", "2")


def tp_pids(server: subprocess.Popen) -> tuple[int, list[int]]:
    """(engine core pid, its worker rank pids) of a server we started."""
    (core,) = [c for c in children(server.pid) if b"rlserve.runtime.core" in Path(f"/proc/{c}/cmdline").read_bytes()]
    workers = [c for c in children(core) if b"rlserve.engine.tp.worker" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return core, workers


def prefix_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits"))


@pytest.fixture(scope="module")
def base(root):
    return make_model("tiny", root / "base", seed=0)


@pytest.fixture(scope="module")
def tp_server(root, base):
    url, proc = start_server(
        "--model.name", str(base), "--weight_roots", json.dumps([str(root)]), "--server.admin_api_key", "admin", *TP2
    )
    try:
        yield url, proc
    finally:
        stop_server(proc)


def one_rank_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from rlserve.engine.engine import Engine
    from rlserve.engine.params import SamplingParams

    engine = Engine(
        Config.model_validate(
            {"model": {"name": str(model_dir), "max_model_len": 512}, "engine": {"kv_cache_bytes": 16 << 20}}
        )
    )
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        engine.close()


@linux_only
def test_two_ranks_run_and_greedy_tokens_match_one_rank_and_transformers(tp_server, base):
    url, proc = tp_server
    _, workers = tp_pids(proc)
    assert len(workers) == 1
    choices = [generate(url, p, max_tokens=16)["choices"][0] for p in PROMPTS]
    assert [c["token_ids"] for c in choices] == one_rank_greedy(base, PROMPTS, 16)
    for prompt, choice in zip(PROMPTS, choices):
        hf_check(base, prompt, choice)
    # prefix caching: block tables are rank 0's, the same on every rank; a repeat hits the cache
    again = generate(url, PROMPTS[0] * 8, max_tokens=16)["choices"][0]
    hits = prefix_cache_hits(url)
    repeat = generate(url, PROMPTS[0] * 8, max_tokens=16)["choices"][0]
    assert repeat["token_ids"] == again["token_ids"]
    assert prefix_cache_hits(url) > hits
    hf_check(base, PROMPTS[0] * 8, repeat)


def test_structured_outputs_hold_on_two_ranks(tp_server):
    """Rank 0 samples, so its grammar masks every row; the constrained text validates and greedy agrees
    with itself on a repeat (the mask does not depend on which rank computed which heads)."""
    url, _ = tp_server
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    schema |= {"required": ["n"], "additionalProperties": False}
    body = {"prompt": "x", "max_tokens": 40, "temperature": 1.0, "seed": 3, "n": 3, "guided_json": schema}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice["text"]
        jsonschema.validate(json.loads(choice["text"]), schema)


def test_disk_update_on_every_rank(tp_server, root):
    url, _ = tp_server
    new = make_model("tiny", root / "step-1", seed=1)
    r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(new)}, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    for prompt in PROMPTS:
        hf_check(new, prompt, generate(url, prompt)["choices"][0])
    # a bad checkpoint is refused on every rank and the served weights stay
    r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(root / "missing")}, headers=ADMIN, timeout=120)
    assert r.status_code >= 400
    hf_check(new, PROMPTS[0], generate(url, PROMPTS[0])["choices"][0])


def test_trainer_push_is_scattered_to_every_rank(tp_server, root):
    url, _ = tp_server
    pushed = make_model("tiny", root / "pushed", seed=4)
    before = httpx.get(f"{url}/metrics", params={"format": "json"}).json()["current_policy_version"]
    assert trainer_push(url, pushed, timeout=300) == [before + 1]
    for prompt in PROMPTS[:2]:
        hf_check(pushed, prompt, generate(url, prompt)["choices"][0])


def test_lora_is_sliced_like_its_base_layers(tp_server, root, base):
    from peft import LoraConfig, get_peft_model

    url, _ = tp_server
    # back to the base weights (earlier tests updated them), then an adapter on every projection:
    # column-parallel (q, k, v, gate, up) and row-parallel (o, down)
    r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(base)}, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    torch.manual_seed(7)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(
            r=4,
            lora_alpha=16,
            init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    ).eval()
    path = root / "adapter"
    peft.save_pretrained(path)
    r = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(path)}, headers=ADMIN, timeout=120
    )
    assert r.status_code == 200, r.text
    for prompt in PROMPTS:
        body = {
            "model": "policy",
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 0,
            "return_token_ids": True,
        }
        c = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        with torch.no_grad():
            logits = peft(torch.tensor([prompt + c["token_ids"]])).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        assert c["token_ids"] == lp.argmax(-1).tolist()
        assert torch.allclose(
            torch.tensor(c["logprobs"]["token_logprobs"]),
            lp.gather(1, torch.tensor(c["token_ids"]).unsqueeze(1)).squeeze(1),
            atol=1e-4,
        )
    # the base model still answers as before next to it; unloading reaches every rank
    hf_check(base, PROMPTS[1], generate(url, PROMPTS[1])["choices"][0])
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "policy"}, headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    hf_check(base, PROMPTS[0], generate(url, PROMPTS[0])["choices"][0])


@linux_only
def test_killed_worker_rank_fails_the_engine_loudly_and_sigterm_leaves_nothing(base):
    url, proc = start_server("--model.name", str(base), *TP2)
    try:
        core, (worker,) = tp_pids(proc)
        with httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
            results: dict[str, httpx.Response] = {}
            started = threading.Event()

            def send(name: str, stream: bool) -> None:
                body = {"prompt": "hi", "max_tokens": 400, "stream": stream, "ignore_eos": True}
                if not stream:
                    results[name] = http.post("/v1/completions", json=body)
                    return
                with http.stream("POST", "/v1/completions", json=body) as resp:
                    lines = []
                    for line in resp.iter_lines():
                        lines.append(line)
                        started.set()
                    resp.lines = lines  # type: ignore[attr-defined]
                    results[name] = resp

            threads = [threading.Thread(target=send, args=(n, n == "stream")) for n in ("plain", "stream")]
            for t in threads:
                t.start()
            assert started.wait(HANG_GUARD_S), "hang guard: no token streamed"
            os.kill(worker, signal.SIGKILL)  # mid-generation: rank 0 is stepping with it
            for t in threads:
                t.join(HANG_GUARD_S)
                assert not t.is_alive(), "hang guard: in-flight request never ended"
            assert results["plain"].status_code >= 500, results["plain"].text
            assert "tensor-parallel rank 1" in results["plain"].text  # the failure names the dead rank
            streamed = "\n".join(results["stream"].lines)
            assert results["stream"].status_code >= 500 or '"error"' in streamed, streamed[-500:]
            wait_until(lambda: http.get("/health").status_code == 503, "/health turns 503")
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code >= 500
        proc.send_signal(signal.SIGTERM)
        proc.wait(HANG_GUARD_S)
        wait_until(lambda: gone(core) and gone(worker), "engine core or rank outlived the server")
    finally:
        stop_server(proc)


@linux_only
@pytest.mark.parametrize("core_start", ["fork", "spawn"])
def test_sigterm_of_the_server_stops_every_rank(base, core_start):
    """Forked (the default: the engine core forks its worker before it loads its model, tp/forked.py, and ps
    shows the name it gives itself) or spawned (`python -m rlserve.engine.tp.worker ...`), SIGTERM ends them."""
    url, proc = start_server("--model.name", str(base), "--engine.core_start", core_start, *TP2)
    try:
        core, workers = tp_pids(proc)
        (cmdline,) = [Path(f"/proc/{w}/cmdline").read_bytes() for w in workers]
        if core_start == "fork":
            assert cmdline.startswith(b"rlserve.engine.tp.worker 1 2"), cmdline
        else:
            assert b"-m\0rlserve.engine.tp.worker\x001\x002" in cmdline, cmdline
        assert generate(url, PROMPTS[0], max_tokens=2)["choices"][0]["token_ids"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(HANG_GUARD_S)
        wait_until(lambda: all(gone(p) for p in [core, *workers]), "a rank outlived the server")
    finally:
        stop_server(proc)


def test_config_checks_say_what_to_change(base):
    from transformers import AutoConfig

    from rlserve.model.shape import ModelShape
    from rlserve.model.tensor_parallel import check_tp
    from rlserve.runtime.machine_fit import check_parallel

    shape = ModelShape.from_hf(AutoConfig.from_pretrained(base))
    with pytest.raises(ValueError, match=r"parallel.tp=3 must divide the model's attention heads \(4\)"):
        check_tp(shape, 3)
    moe = ModelShape.from_hf(AutoConfig.from_pretrained(make_model("tiny-moe", base.parent / "moe")))
    with pytest.raises(ValueError, match=r"experts' intermediate size \(64\).*enable_expert_parallel"):
        check_tp(moe, 3)
    check_tp(moe, 2)  # tiny-moe splits two ways: 4 heads, 2 KV heads, experts of 64
    cores = os.cpu_count() or 1
    too_many = Config.model_validate({"parallel": {"tp": cores + 1}, "model": {"device": "cpu"}})
    with pytest.raises(ValueError, match="lower parallel.dp or parallel.tp"):
        check_parallel(too_many)
    one_rank = Config.model_validate({"num_threads": cores + 1, "model": {"device": "cpu"}})
    with pytest.raises(ValueError, match=rf"num_threads={cores + 1} oversubscribes the {cores} CPU cores"):
        check_parallel(one_rank)
    check_parallel(
        one_rank.model_copy(update={"parallel": one_rank.parallel.model_copy(update={"oversubscribe_cpu": True})})
    )
    in_thread = Config.model_validate({"parallel": {"tp": 2}, "engine": {"core_process": False}})
    with pytest.raises(ValueError, match="core_process"):
        check_parallel(in_thread)
    # P/D KV transfer and the Mooncake store run under tp now, with whole blocks (test_pd_tp.py)


def test_server_refuses_a_tp_the_model_cannot_split(base):
    with pytest.raises(RuntimeError) as info:
        start_server("--model.name", str(base), "--parallel.tp", "3", "--num_threads", "1", timeout=120)
    assert "parallel.tp" in str(info.value)


def test_step_inputs_cross_as_fixed_schema_msgspec_never_pickle():
    import pickle

    import msgspec

    from rlserve.engine.tp import comm as parallel
    from rlserve.model.batch import AttentionBatch, PrefillSeq

    attn = AttentionBatch(
        slot_mapping=torch.tensor([5, 6, 7]),
        num_decode=1,
        decode_blocks=torch.tensor([0, 1]),
        decode_mask=torch.tensor([[True, False]]).view(1, 1, 1, 2),
        decode_lens=torch.tensor([17]),
        cascade=None,
        prefills=[PrefillSeq(1, 2, 4, torch.tensor([0, 1, 2, 3]), torch.ones(2, 4, dtype=torch.bool).tril(2))],
    )
    raw = parallel.encode_step(torch.tensor([3, 4, 5]), torch.tensor([16, 2, 3]), attn, [(1, 2)])
    step = parallel.to_worker.decode(raw)
    assert isinstance(step, parallel.Step) and step.block_copies == [(1, 2)] and not step.kernels
    cpu = torch.device("cpu")
    assert torch.equal(step.decode_mask.to(cpu), attn.decode_mask) and step.decode_mask.to(cpu).dtype == torch.bool
    assert torch.equal(step.prefills[0].mask.to(cpu), attn.prefills[0].mask)
    assert torch.equal(step.input_ids.to(cpu), torch.tensor([3, 4, 5]))
    bf16 = torch.randn(3, 2).bfloat16()
    assert torch.equal(
        msgspec.msgpack.decode(msgspec.msgpack.encode(parallel.Tensor.of(bf16)), type=parallel.Tensor).to(cpu), bf16
    )
    with pytest.raises(msgspec.DecodeError):
        parallel.to_worker.decode(pickle.dumps(step))
    with pytest.raises(KeyError):  # only the dtypes a step uses
        parallel.Tensor("object", [1], b"x").to(cpu)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_the_served_weights_are_put_together_from_every_rank(root, preset):
    """What a deployment keeps after a trainer's push (runtime/weight_snapshot.py): under tp=2 each checkpoint
    tensor is gathered from both ranks' slices (MoE's experts split within each expert) and equals the
    checkpoint bit for bit, so a replica restarted after a push can replay it."""
    from safetensors.torch import load_file

    from rlserve.engine.engine import Engine
    from rlserve.runtime.weight_snapshot import checkpoint_tensors

    model_dir = make_model(preset, root / f"copy-{preset}", seed=5)
    cfg = {"model": {"name": str(model_dir), "max_model_len": 512}, "engine": {"kv_cache_bytes": 16 << 20}}
    engine = Engine(Config.model_validate(cfg | {"parallel": {"tp": 2}}))
    try:
        got = checkpoint_tensors(engine.model, engine.tp, call_id=1)
    finally:
        engine.close()
    want = {name: t for f in sorted(model_dir.glob("*.safetensors")) for name, t in load_file(f).items()}
    assert got and set(got) <= set(want)
    for name, tensor in got.items():
        assert torch.equal(tensor.to(want[name].dtype), want[name]), name


def test_unshard_undoes_shard_for_every_kind_of_tensor():
    from rlserve.model.tensor_parallel import shard, unshard

    names = {
        "model.layers.0.self_attn.q_proj.weight": (8, 6),
        "model.layers.0.self_attn.o_proj.weight": (6, 8),
        "model.layers.1.mlp.experts.3.gate_proj.weight": (8, 6),
        "model.layers.1.mlp.experts.3.down_proj.weight": (6, 8),
        "model.layers.1.mlp.experts.gate_up_proj": (4, 16, 6),  # [E, 2I, H]: gate rows, then up rows
        "model.layers.1.mlp.experts.down_proj": (4, 6, 8),
        "model.norm.weight": (6,),
    }
    for name, shape in names.items():
        full = torch.randn(shape)
        for tp in (2, 4):
            assert torch.equal(unshard(name, [shard(name, full, r, tp) for r in range(tp)]), full), (name, tp)


FORK_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from rlserve.config.schema import Config
from rlserve.engine.tp import forked

config = Config.model_validate({"parallel": {"tp": 3}})
forked.fork_waiting_workers(config)
pids = [proc.pid for proc, _ in forked._waiting.values()]
assert len(pids) == 2, pids
deadline = time.monotonic() + 60
while not all(Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"rlserve.engine.tp.worker") for p in pids):
    assert time.monotonic() < deadline, "hang guard: the children never named themselves"
    time.sleep(0.05)
if sys.argv[1] == "release":
    proc = forked.start(1, ["1", "3", "not-an-address"], config.model_dump_json().encode())
    forked.release()  # rank 2: never told
    assert proc.wait(60) != 0  # rank 1 was told, and failed on its arguments
    assert all(not os.path.exists(f"/proc/{p}") for p in pids), "a child is left unreaped"
    print("ok")
else:  # the core dies without a word to its children
    print(json.dumps(pids), flush=True)
    os._exit(0)
"""


@linux_only
def test_waiting_workers_are_told_or_let_go_and_die_with_the_core(tmp_path):
    """tp/forked.py: a waiting child runs as the rank it is told, with that rank's arguments; one never told
    exits when the core lets it go, and both exit when the core dies without a word."""
    script = tmp_path / "forked.py"
    script.write_text(FORK_SCRIPT)
    done = subprocess.run([sys.executable, str(script), "release"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    assert "not enough values to unpack" in done.stderr  # rank 1's own report of its bad arguments
    done = subprocess.run([sys.executable, str(script), "die"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pids = json.loads(done.stdout.splitlines()[-1])
    wait_until(lambda: all(gone(p) for p in pids), "a waiting worker outlived its core")
