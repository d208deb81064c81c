"""`vllm serve MODEL --flag ...` as rlserve flags (docs/launch.md lists every flag and what it sets)."""

from __future__ import annotations

import re
from collections.abc import Callable

from rlserve.config.dialects import Flag
from rlserve.config.errors import ConfigError

_DTYPES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


def _dtype(value: str) -> str:
    if value not in _DTYPES:
        raise ConfigError(f"--dtype {value!r}: rlserve runs {', '.join(_DTYPES)}")
    return _DTYPES[value]


def _logprobs_mode(value: str) -> str:
    if value not in _LOGPROBS_MODES:
        raise ConfigError(f"--logprobs-mode {value!r}: choose one of {', '.join(_LOGPROBS_MODES)}")
    return value


def _length(value: str) -> str:
    """vLLM's 32k / 1M / 32768 spellings."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?)", value.strip())
    if m is None:
        raise ConfigError(f"--max-model-len {value!r}: give a number of tokens (e.g. 4096, 32k)")
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1_000_000, "M": 1 << 20}[m.group(2)]
    return str(int(float(m.group(1)) * scale))


def _one_of(flag: str, allowed: tuple[str, ...], why: str) -> Callable[[str], str]:
    """A converter that passes a value in `allowed` through and refuses any other, saying why."""

    def convert(value: str) -> str:
        if value not in allowed:
            raise ConfigError(f"{flag} {value!r}: {why}")
        return value

    return convert


_generation_config = _one_of(
    "--generation-config",
    ("auto", "vllm"),
    "rlserve reads generation_config.json from the model directory only (pass auto or vllm)",
)
_structured_backend = _one_of(
    "--structured-outputs-config.backend",
    ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"),
    "not one of vLLM's backends",
)
_content_format = _one_of(
    "--chat-template-content-format",
    ("auto", "string"),
    "rlserve renders a message's text parts as one string (pass auto or string)",
)
_runner = _one_of("--runner", ("auto", "generate"), "rlserve serves generative models only (pass auto or generate)")


def _one(value: str) -> str:
    if value.strip() not in ("1", ""):
        raise ConfigError(
            f"--pipeline-parallel-size {value}: rlserve has no pipeline parallelism; use "
            "--tensor-parallel-size or --data-parallel-size"
        )
    return value


_EACH_SERVER_SERVES = "every server serves HTTP for its own engines; put the servers behind vllm-router"
_dp_backend = _one_of(
    "--data-parallel-backend",
    ("mp",),
    'rlserve runs a server\'s engines as its own processes; on Ray, use deployment.type = "multi_node"',
)


VLLM_FLAGS: dict[str, Flag] = {
    "--model": Flag("model.name"),
    "--host": Flag("server.host"),
    "--port": Flag("server.port"),
    "--api-key": Flag("server.api_key"),
    "--served-model-name": Flag("model.served_model_name"),
    "--max-model-len": Flag("model.max_model_len", convert=_length),
    "--dtype": Flag("model.dtype", convert=_dtype),
    "--seed": Flag("seed"),
    "--tensor-parallel-size": Flag("parallel.tp"),
    "-tp": Flag("parallel.tp"),
    "--tool-call-parser": Flag("model.tool_call_parser"),
    "--reasoning-parser": Flag("model.reasoning_parser"),
    "--gpu-memory-utilization": Flag("gpu_memory_utilization"),
    "--logprobs-mode": Flag("engine.logprobs_mode", convert=_logprobs_mode),
    "--chat-template": Flag("model.chat_template"),
    "--max-num-seqs": Flag("engine.max_num_seqs"),
    "--max-num-batched-tokens": Flag("engine.max_num_batched_tokens"),
    "--block-size": Flag("engine.block_size"),
    "--max-logprobs": Flag("engine.max_logprobs"),
    "--device": Flag("model.device"),
    "--uvicorn-log-level": Flag("server.log_level"),
    "--root-path": Flag("server.root_path"),
    "--enable-prefix-caching": Flag("engine.enable_prefix_caching", switch=True),
    "--no-enable-prefix-caching": Flag("engine.enable_prefix_caching", switch=True, const="false"),
    "--enforce-eager": Flag("model.enforce_eager", switch=True),
    "--enable-prompt-tokens-details": Flag("server.enable_prompt_tokens_details", switch=True),
    "--enable-per-request-metrics": Flag("server.enable_per_request_metrics", switch=True),
    "--enable-force-include-usage": Flag("server.enable_force_include_usage", switch=True),
    "--return-tokens-as-token-ids": Flag("server.return_tokens_as_token_ids", switch=True),
    "--exclude-tools-when-tool-choice-none": Flag("server.exclude_tools_when_tool_choice_none", switch=True),
    "--trust-remote-code": Flag("model.trust_remote_code", switch=True),
    "--enable-return-routed-experts": Flag("enable_return_routed_experts", switch=True),
    "--enable-expert-parallel": Flag("parallel.enable_expert_parallel", switch=True),
    "-ep": Flag("parallel.enable_expert_parallel", switch=True),
    "--enable-eplb": Flag("parallel.enable_eplb", switch=True),
    "--enable-dbo": Flag("parallel.enable_dbo", switch=True),
    # accepted and ignored: rlserve already behaves as the flag asks, or has no such limit
    "--enable-auto-tool-choice": Flag(
        None, switch=True, note="tool calls are parsed whenever --tool-call-parser is set and a request has tools"
    ),
    "--enable-lora": Flag(None, switch=True, note="LoRA adapters are always served"),
    "--max-lora-rank": Flag(None, note="any rank loads"),
    "--max-loras": Flag(None, note="adapters stay loaded until unloaded; requests of any mix share a batch"),
    "--max-cpu-loras": Flag(None, note="as --max-loras"),
    "--enable-scale-out": Flag(
        None,
        switch=True,
        note="the scale-out and dev-mode routes are always served, "
        "behind server.admin_api_key (VLLM_SERVER_DEV_MODE is not needed either)",
    ),
    "--generation-config": Flag(
        None,
        convert=_generation_config,
        note="eos ids come from the model's generation_config.json; sampling defaults are vLLM's neutral ones",
    ),
    "--disable-log-requests": Flag(None, switch=True, note="requests are not logged"),
    "--enable-log-requests": Flag(None, switch=True, note="requests are not logged"),
    "--disable-log-stats": Flag(None, switch=True, note="stats are on /metrics only"),
    "--disable-uvicorn-access-log": Flag(None, switch=True, note="no access log"),
    "--enable-request-id-headers": Flag(None, switch=True, note="X-Request-Id is on every response"),
    "--enable-tokenizer-info-endpoint": Flag(None, switch=True, note="GET /tokenizer_info is always served"),
    "--enable-server-load-tracking": Flag(None, switch=True, note="/load always counts the requests in flight"),
    "--pipeline-parallel-size": Flag(None, convert=_one, note="1 only"),
    "--data-parallel-hybrid-lb": Flag(None, switch=True, note=_EACH_SERVER_SERVES),
    "-dph": Flag(None, switch=True, note=_EACH_SERVER_SERVES),
    "--data-parallel-external-lb": Flag(None, switch=True, note=_EACH_SERVER_SERVES),
    "-dpe": Flag(None, switch=True, note=_EACH_SERVER_SERVES),
    "--data-parallel-backend": Flag(None, convert=_dp_backend, note="mp: the engines are this server's processes"),
    "-dpb": Flag(None, convert=_dp_backend, note="mp: the engines are this server's processes"),
    "--runner": Flag(None, convert=_runner, note="auto or generate: rlserve serves generative models"),
    "--structured-outputs-config.backend": Flag(
        None, convert=_structured_backend, note="constraints always compile with llguidance"
    ),
    "--chat-template-content-format": Flag(
        None, convert=_content_format, note="a message's text parts reach the template as one string"
    ),
}

# vLLM flags with nothing behind them in rlserve: refused by name rather than half-honoured
REFUSED = {
    "--quantization": "rlserve serves unquantized checkpoints only; drop the flag",
    "--speculative-config": "rlserve has no speculative decoding; drop the flag",
    "--kv-transfer-config": 'rlserve moves KV between its own servers: use deployment.type = "disaggregated"',
    "--enable-prompt-embeds": "rlserve takes prompts as text or token ids, not embeddings; drop the flag",
    "--limit-mm-per-prompt": "rlserve serves text-only models; drop the flag",
    "--tool-server": "rlserve's /v1/responses runs no built-in tools or MCP servers; drop the flag",
    "--worker-extension-cls": "rlserve loads no user worker classes; /collective_rpc offers a named allow-list",
    "--skip-tokenizer-init": "rlserve needs the model's tokenizer (it detokenizes and renders chat); drop the flag",
    "--reasoning-config": "rlserve has no thinking_token_budget, which this configures; drop the flag",
    "--watermark-config": "rlserve does not watermark its outputs; drop the flag",
    "--uds": "rlserve listens on TCP only; use --host and --port",
    "--headless": "rlserve has no headless engine ranks: on each node, start a server with --data-parallel-size-local "
    "and --data-parallel-start-rank (its engines join the group) and put the servers behind vllm-router",
    "-dpm": "rlserve starts no per-rank API servers; give each server --data-parallel-rank (one engine each)",
    "--data-parallel-multi-port-external-lb": "rlserve starts no per-rank API servers; give each server "
    "--data-parallel-rank (one engine each)",
}


# vLLM's data-parallel flags, read together: --data-parallel-size alone is one server's engines; with
# --data-parallel-size-local (and --data-parallel-start-rank on later nodes) it is a group spread over servers,
# this server running its share (vLLM's hybrid load balancing); --data-parallel-rank is one engine of the group
# per server (external load balancing). A group over servers is rlserve's Wide-EP (docs/expert-parallel.md).
DATA_PARALLEL = {
    "--data-parallel-size": "size",
    "-dp": "size",
    "--data-parallel-size-local": "local",
    "-dpl": "local",
    "--data-parallel-start-rank": "start",
    "-dpr": "start",
    "--data-parallel-rank": "rank",
    "-dpn": "rank",
    "--data-parallel-address": "address",
    "-dpa": "address",
    "--data-parallel-rpc-port": "port",
    "-dpp": "port",
}
VLLM_DP_RPC_PORT = "29550"  # vLLM's default port for the group's rendezvous


def data_parallel_settings(given: dict[str, str]) -> dict[str, str]:
    """rlserve's parallel keys and values for vLLM's data-parallel flags (`given`: DATA_PARALLEL's role -> value);
    a launch line and prime-rl's vllm_extra read them alike."""

    def number(role: str) -> int | None:
        if role not in given:
            return None
        value = str(given[role]).strip()
        if not value.isdigit():
            flag = next(name for name, r in DATA_PARALLEL.items() if r == role)
            raise ConfigError(f"{flag} {value!r}: give a whole number")
        return int(value)

    size, local, start, rank = number("size"), number("local"), number("start"), number("rank")
    if rank is not None:  # one engine per server
        if local not in (None, 1) or (start is not None and start != rank):
            raise ConfigError(
                "--data-parallel-rank runs one engine of the group on this server: leave out "
                "--data-parallel-size-local (or give 1) and --data-parallel-start-rank"
            )
        local, start = 1, rank
    out: dict[str, str] = {}
    port = given.get("port")
    if local is None or size is None or local >= size:
        if local is not None and size is not None and local > size:
            raise ConfigError(f"--data-parallel-size-local {local} is more than --data-parallel-size {size}")
        if start:
            raise ConfigError("--data-parallel-start-rank needs --data-parallel-size-local below --data-parallel-size")
        dp = local if local is not None else size
        if dp is not None:
            out["parallel.dp"] = str(dp)
    else:
        out["parallel.dp"], out["parallel.data_parallel_size"] = str(local), str(size)
        out["parallel.data_parallel_start_rank"] = str(start or 0)
        port = port or VLLM_DP_RPC_PORT
    if "address" in given:
        out["parallel.data_parallel_address"] = str(given["address"])
    if port is not None:
        out["parallel.data_parallel_rpc_port"] = str(port)
    return out
