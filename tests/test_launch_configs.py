"""Other servers' launch lines and config files load as written: vLLM's flags (positional model), NeMo Gym's
line, prime-rl's inference docs (one test per TOML block), and every file under configs/."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest

from conftest import start_server, stop_server
from rlserve.config.dialects import translate_launch_line
from rlserve.config.load import ConfigError, load_config
from rlserve.model.make import default_model_dir

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "tests" / "fixtures" / "prime_rl_docs").glob("*.toml"))
CONFIGS = sorted((ROOT / "configs").rglob("*.toml"))


def launch(*argv: str):
    return load_config(translate_launch_line(list(argv)))


def test_vllm_flags_set_rlserve_keys():
    c = launch(
        "/models/m",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--api-key",
        "k",
        "--served-model-name",
        "name",
        "--max-model-len",
        "32k",
        "--dtype",
        "half",
        "--seed",
        "3",
        "--tensor-parallel-size",
        "2",
        "--data-parallel-size",
        "2",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--enable-lora",
        "--max-lora-rank",
        "64",
        "--max-loras",
        "4",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.9",
        "--logprobs-mode",
        "raw_logprobs",
        "--chat-template",
        "t.jinja",
        "--generation-config",
        "auto",
        "--enable-scale-out",
        "--trust-remote-code",
        "--runner",
        "generate",
        "--enable-force-include-usage",
        "--return-tokens-as-token-ids",
        "--exclude-tools-when-tool-choice-none",
        "--structured-outputs-config.backend",
        "xgrammar",
        "--chat-template-content-format",
        "string",
    )
    assert c.server.enable_force_include_usage and c.server.return_tokens_as_token_ids
    assert c.server.exclude_tools_when_tool_choice_none
    assert launch("m", "--runner=auto").model.name == "m"
    # vLLM's underscore spellings; rlserve's own top-level keys keep theirs
    assert launch("m", "--max_model_len", "64", "--enable_force_include_usage").model.max_model_len == 64
    assert launch("m", "--gpu_memory_utilization", "0.5").gpu_memory_utilization == 0.5
    assert (c.model.name, c.server.host, c.server.port, c.server.api_key) == ("/models/m", "0.0.0.0", 9000, "k")
    assert (c.model.served_model_name, c.model.max_model_len, c.model.dtype, c.seed) == ("name", 32000, "float16", 3)
    assert (c.parallel.tp, c.parallel.dp, c.model.tool_call_parser, c.model.reasoning_parser) == (
        2,
        2,
        "hermes",
        "qwen3",
    )
    assert not c.engine.enable_prefix_caching and c.model.enforce_eager and c.model.trust_remote_code
    assert (c.gpu_memory_utilization, c.engine.logprobs_mode, c.model.chat_template) == (0.9, "raw_logprobs", "t.jinja")
    assert launch("--port=9001", "--enable-prefix-caching").engine.enable_prefix_caching


def test_vllm_data_parallel_flags_are_read_together():
    def parallel(*argv):
        p = launch("m", *argv).parallel
        return p.dp, p.data_parallel_size, p.data_parallel_start_rank, p.data_parallel_address, p.data_parallel_rpc_port

    assert parallel("--data-parallel-size", "2") == (2, None, 0, "127.0.0.1", None)  # one server's engines
    assert parallel("-dp", "4", "-dpl", "4") == (4, None, 0, "127.0.0.1", None)  # all of them on this node
    # vLLM's multi-node example: the head node, then the next with its start rank (an expert group over servers)
    head = ("-ep", "-dp", "4", "-dpl", "2", "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345")
    assert parallel(*head) == (2, 4, 0, "10.0.0.1", 13345)
    assert parallel(*head, "--data-parallel-start-rank", "2") == (2, 4, 2, "10.0.0.1", 13345)
    # one engine per server (external load balancing), and vLLM's default rendezvous port
    assert parallel("-ep", "-dp", "4", "--data-parallel-rank", "3", "-dpe", "-dpa", "h") == (1, 4, 3, "h", 29550)
    assert parallel("--data_parallel_size=2", "--data-parallel-backend", "mp") == (2, None, 0, "127.0.0.1", None)
    for argv, named in [
        (("-dp", "2", "-dpl", "3"), "more than --data-parallel-size"),
        (("-dp", "2", "--data-parallel-start-rank", "1"), "--data-parallel-start-rank needs"),
        (("-ep", "-dp", "4", "--data-parallel-rank", "1", "-dpl", "2"), "one engine of the group"),
        (("-dp", "two"), "--data-parallel-size 'two': give a whole number"),
        (("-dp", "4", "-dpl", "2"), "set enable_expert_parallel"),  # a group over servers shares experts
        (("--data-parallel-backend", "ray"), 'deployment.type = "multi_node"'),
        (("--headless",), "--data-parallel-start-rank"),
        (("-dpm",), "--data-parallel-rank"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(named)):
            launch("m", *argv)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--logprobs-mode", "logits"], "--logprobs-mode"),
        (["--speculative-config", "{}"], "--speculative-config"),
        (["--served-model-name", "a", "b"], "--served-model-name"),
        (["--swap-space", "4"], "--swap-space"),
        (["infer.toml"], "@ infer.toml"),
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
        (["--generation-config", "/models/gen"], "--generation-config"),
        (["--runner", "pooling"], "--runner"),
        (["--enable-prompt-embeds"], "--enable-prompt-embeds"),
        (["--chat-template-content-format", "openai"], "--chat-template-content-format"),
        (["--structured-outputs-config.backend", "mine"], "--structured-outputs-config.backend"),
        (["--limit-mm-per-prompt", "{}"], "--limit-mm-per-prompt"),
        (["--tool-server", "demo"], "--tool-server"),
        (["--reasoning-config", "{}"], "--reasoning-config"),
        (["--uds", "/tmp/s.sock"], "--uds"),
        (["--watermark-config", "{}"], "--watermark-config"),
    ],
)
def test_inapplicable_vllm_flags_are_refused_by_name(argv, named):
    with pytest.raises(ConfigError, match=named):
        launch(*argv)


def test_mlx_flags_set_rlserve_keys():
    c = launch(
        "--model",
        "m",
        "--max-batch",
        "5",
        "--flush-interval-ms",
        "10",
        "--max-tokens",
        "64",
        "--adapter-path",
        "/a",
        "--log-level",
        "DEBUG",
        "--trust-remote-code",
    )
    assert (c.model.name, c.engine.max_num_seqs, c.engine.batch_window_ms, c.server.generate_max_tokens) == (
        "m",
        5,
        10.0,
        64,
    )
    assert (c.model.adapter_path, c.server.log_level, c.server.metrics_format) == ("/a", "debug", "json")
    assert launch("--model", "m").server.metrics_format == "prometheus"  # a vLLM-style line keeps Prometheus
    assert launch("--model", '{"name": "x"}').model.name == "x"  # rlserve's own JSON form still works


def test_vllm_launch_line_serves():
    head = (str(default_model_dir()),)
    url, proc = start_server(
        "--api-key",
        "key",
        "--served-model-name",
        "served",
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--seed",
        "1",
        "--tensor-parallel-size",
        "1",
        "--data-parallel-size",
        "1",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--enable-lora",
        "--max-lora-rank",
        "64",
        "--max-loras",
        "2",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "auto",
        "--enable-scale-out",
        head=head,
    )
    try:
        headers = {"Authorization": "Bearer key"}
        resp = httpx.post(
            f"{url}/v1/completions",
            headers=headers,
            timeout=300,
            json={"model": "served", "prompt": "hi", "max_tokens": 3},
        )
        assert resp.status_code == 200 and resp.json()["model"] == "served"
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=60).status_code == 401
        # --enable-scale-out changes nothing: the dev-mode routes are served, and a key still gates them
        assert httpx.post(f"{url}/reset_prefix_cache", timeout=60).status_code == 401
        assert httpx.post(f"{url}/reset_prefix_cache", headers=headers, timeout=60).status_code == 200
    finally:
        stop_server(proc)


def test_nemo_gym_launch_line_starts():
    # NeMo Gym's docs: vllm serve MODEL --tensor-parallel-size 1 --max-model-len 32768 --tool-call-parser hermes
    # --host 0.0.0.0 --port 8000; here a local model, a free port, and the admin key rlserve asks off loopback.
    # The embedded model's position table holds 4096 tokens, and a longer max-model-len is refused at start
    # (as vLLM does), so the line asks for that; NeMo Gym's Qwen3 models take its 32768.
    url, proc = start_server(
        "--tensor-parallel-size",
        "1",
        "--max-model-len",
        "4096",
        "--tool-call-parser",
        "hermes",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--server.admin-api-key",
        "a",
        "--engine.kv_cache_bytes",
        str(64 << 20),
        head=(str(default_model_dir()),),
        defaults=(),
    )
    try:
        url = url.replace("0.0.0.0", "127.0.0.1")
        resp = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=300,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert resp.status_code == 200, resp.text
    finally:
        stop_server(proc)


# ---- prime-rl's inference docs: one test per TOML block ------------------------------------------------

REFUSED_BLOCKS = {  # what rlserve cannot do yet, refused with the key named
    "09_router_llm_d.toml": "llm-d",
    "13_vllm_extra.toml": "vllm_extra.headless",
}


@pytest.mark.parametrize("path", DOCS, ids=[p.stem for p in DOCS])
def test_prime_rl_docs_block_loads(path):
    if path.name in REFUSED_BLOCKS:
        with pytest.raises(ConfigError, match=REFUSED_BLOCKS[path.name]):
            load_config(["@", str(path)])
        return
    load_config(["@", str(path)])


def test_prime_rl_layout_reads_inference_and_logs_what_it_ignores(tmp_path, caplog):
    path = tmp_path / "rl.toml"
    path.write_text(
        '[deployment]\ntype = "multi_node"\nnum_train_nodes = 4\nnum_infer_nodes = 2\n\n'
        '[trainer]\nlr = 1e-6\n\n[inference]\nmodel = "m"\nenv_vars = { "A" = "1" }\n'
        '[inference.deployment]\ntype = "multi_node"\nnum_replicas = 1\n'
        '[inference.deployment.router]\ntype = "vllm-router"\n'
        "[inference.vllm_extra]\nmax_num_seqs = 7\nenforce_eager = true\ndata_parallel_size = 2\n"
    )
    with caplog.at_level(logging.INFO, logger="rlserve.config.schema"):
        c = load_config(["@", str(path)])
    assert (c.model.name, c.env_vars, c.deployment.num_nodes, c.engine.max_num_seqs) == ("m", {"A": "1"}, 2, 7)
    assert c.model.enforce_eager and c.parallel.dp == 2
    assert any("num_train_nodes" in r.message and "type" in r.message for r in caplog.records)
    assert any("trainer" in r.message for r in caplog.records)


def test_num_infer_replicas_makes_copies_with_their_own_router_ports():
    (path,) = [p for p in DOCS if p.name == "08_rl_deployment.toml"]
    d = load_config(["@", str(path)]).deployment
    assert (d.copies, d.size, d.copy_of(2)) == (3, 3, 2)
    d = load_config(["--server.port", "8000", "--deployment.copies", "2", "--deployment.replicas", "2"]).deployment
    assert [d.router_port(c, 8000) for c in range(2)] == [8000, 8002]  # 8001: the admin address
    assert [d.copy_of(i) for i in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ConfigError, match="admin_port"):
        load_config(["--server.port", "8000", "--deployment.copies", "3", "--deployment.admin_port", "8003"])
    # each copy of a disaggregated deployment has its own prefill and decode servers
    d = load_config(["--deployment.type", "disaggregated", "--deployment.copies", "2"]).deployment
    assert [(d.copy_of(i), d.role(i)) for i in range(d.size)] == [
        (0, "prefill"),
        (0, "decode"),
        (1, "prefill"),
        (1, "decode"),
    ]


def test_router_non_cached_tokens_moves_to_the_deployment(tmp_path):
    path = tmp_path / "pd.toml"
    path.write_text(
        '[inference.deployment]\ntype = "disaggregated"\n[inference.deployment.router]\n'
        'type = "vllm-router"\nnon_cached_tokens = 16\n'
    )
    assert load_config(["@", str(path)]).deployment.non_cached_tokens == 16


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT / "configs")) for p in CONFIGS])
def test_every_shipped_config_loads(path):
    load_config(["@", str(path)])


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    from rlserve.model.make import make_model

    return make_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe")


DOC = "../tests/fixtures/prime_rl_docs/"
TMP_DISK = ("--kv_cache_offload.disk.path", "TMP")
# (file under configs/, local changes: only what this machine needs) for everything one machine can run
RUNNABLE = [
    ("debug/infer.toml", ()),
    ("offload.toml", ()),
    ("replay.toml", ("--model.name", "MOE")),
    (DOC + "00_deployment_type.toml", ()),
    (DOC + "02_single_node.toml", ()),
    (DOC + "10_routing_headers.toml", ()),
    (DOC + "11_offload_native_cpu.toml", ("--kv_cache_offload.cpu.num_bytes", str(64 << 20))),  # not 128 GB
    # not 128 GB, and a directory that exists here instead of /scratch/kv
    (DOC + "11_offload_native_cpu_disk.toml", ("--kv_cache_offload.cpu.num_bytes", str(64 << 20), *TMP_DISK)),
    (DOC + "11_offload_mooncake.toml", ("--kv_cache_offload.cpu.num_bytes", str(64 << 20), *TMP_DISK)),
    # tp = 2 x dp = 4: 8 expert-parallel ranks on 2 cores, a tiny MoE for the docs' INTELLECT-3
    (DOC + "03_single_node_ep.toml", ("--model.name", "MOE", "--parallel.oversubscribe_cpu", "true")),
    (DOC + "14_router_replay.toml", ("--model.name", "MOE")),
]


@pytest.mark.parametrize("name, extra", RUNNABLE, ids=[Path(n).stem for n, _ in RUNNABLE])
def test_runnable_configs_serve(name, extra, moe_dir, tmp_path):
    if "mooncake" in name:
        from test_kv_mooncake import _mooncake_or_skip

        _mooncake_or_skip()
    extra = tuple({"MOE": str(moe_dir), "TMP": str(tmp_path)}.get(x, x) for x in extra)
    url, proc = start_server("@", str(ROOT / "configs" / name), *extra, "--server.port", "0")
    try:
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=300)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        if "replay" in name:
            gen = httpx.post(
                f"{url}/inference/v1/generate",
                timeout=300,
                json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}},
            ).json()
            assert gen["choices"][0]["routed_experts"] is not None
    finally:
        stop_server(proc)


@pytest.mark.parametrize("block", ["11_offload_native_cpu_disk.toml", "11_offload_mooncake.toml"])
def test_docs_disk_blocks_as_written_name_the_missing_directory(block):
    """/scratch/kv does not exist here: the server exits with a message that says so, before loading a model."""
    import subprocess
    import sys

    if "mooncake" in block:
        from test_kv_mooncake import _mooncake_or_skip

        _mooncake_or_skip()
    if Path("/scratch/kv").exists():
        pytest.skip("this machine has the docs' /scratch/kv")
    out = subprocess.run(
        [sys.executable, "-m", "rlserve.cli", "serve", "@", str(ROOT / "tests/fixtures/prime_rl_docs" / block),
         "--kv_cache_offload.cpu.num_bytes", str(64 << 20), "--server.port", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode != 0
    assert "kv_cache_offload.disk.path '/scratch/kv' is not an existing directory: create it" in out.stderr


@pytest.mark.slow  # three deployments of 2-3 processes each behind vllm-router
@pytest.mark.parametrize(
    "name",
    ["single_node.toml", "disaggregated.toml", DOC + "12_pd_env_vars.toml"],
    ids=["single_node", "disaggregated", "12_pd_env_vars"],
)
def test_runnable_deployments_serve_and_share_env_vars(name):
    from deploy_helpers import descendants, start_deployment, stop_deployment

    public, _, proc = start_deployment("@", str(ROOT / "configs" / name), "--env_vars", '{"RLSERVE_ENV_MARK": "on"}')
    try:
        resp = httpx.post(f"{public}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=300)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        servers = [pid for pid in descendants(proc.pid) if b"rlserve" in _read(f"/proc/{pid}/cmdline")]
        assert len(servers) >= 2
        assert all(b"RLSERVE_ENV_MARK=on" in _environment(pid) for pid in servers)
    finally:
        stop_deployment(proc)


def _environment(pid: int) -> bytes:
    """The environment `pid` started with: /proc/PID/environ, or for a process forked and renamed by setproctitle
    (a replica forked from the preloaded process, a forked engine core), whose rename wrote over that memory, its
    parent's, which the fork copied."""
    environ = _read(f"/proc/{pid}/environ")
    if b"=" in environ:
        return environ
    ppid = int(_read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[1])
    return _environment(ppid) if ppid > 1 else environ


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""
