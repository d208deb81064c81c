"""The whole config tree. Loading from files, flags and env lives in config/load.py; the rules that span
sections (checked whenever a Config is built) in config/checks.py."""

from __future__ import annotations

import logging
import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlserve.config.checks import check_combinations
from rlserve.config.deployment import DeploymentConfig
from rlserve.config.section import Section


class ModelConfig(Section):
    name: str | None = Field(None, description="HF model directory or hub id; none = the embedded default model")
    max_model_len: int | None = Field(None, ge=2, description="context length; none = the model's own")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        "auto",
        description="auto = float32 on CPU (exact against an fp32 trainer), bfloat16 on CUDA; bfloat16 on "
        "CPU is the fast path where the CPU has native bf16 (AVX512_BF16 or AMX); float64 is a reference "
        "run (slow: torch's kernels, logits and logprobs in float64) for checking a layout's math against a "
        "float64 forward with rounding out of the way",
    )
    lm_head_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of the LM head and the logits after it (log_softmax and sampling are always "
        "float32, or float64 for a float64 model); auto = float32 (float64 for a float64 model), which for a "
        "bf16 model costs a float32 copy of the head weight and keeps logprobs close to an fp32 forward; set "
        "it to the model dtype to run the head in that",
    )
    device: str = Field(
        default_factory=lambda: os.environ.get("RLSERVE_DEVICE") or "auto",
        description="auto, cpu, cuda, cuda:N or mps; its default is $RLSERVE_DEVICE when set, else auto "
        "(cuda where torch sees a GPU)",
    )
    enforce_eager: bool = Field(False, description="never capture CUDA graphs")
    trust_remote_code: bool = Field(False, description="allow custom code from the model directory")
    chat_template: str | None = Field(
        None, description="a Jinja chat template (file path or inline) replacing the model's"
    )
    served_model_name: str | None = Field(None, description="the name clients use; default = model.name")
    # vLLM's names; rlserve.server.parsers holds one parser per name (docs/parsers.md).
    tool_call_parser: (
        Literal[
            "hermes",
            "qwen3_json",
            "qwen3_coder",
            "qwen3_xml",
            "glm45",
            "glm47",
            "deepseek_v3",
            "deepseek_v31",
            "kimi_k2",
            "openai",
            "llama3_json",
            "llama4_json",
            "llama4_pythonic",
            "pythonic",
            "mistral",
            "granite",
            "internlm",
            "minimax_m2",
            "seed_oss",
            "xlam",
            "phi4_mini_json",
        ]
        | None
    ) = Field(None, description="parse tool calls out of chat output when a request has tools; none = raw text")
    reasoning_parser: (
        Literal[
            "qwen3",
            "deepseek_r1",
            "deepseek_v3",
            "glm45",
            "kimi_k2",
            "openai_gptoss",
            "granite",
            "minimax_m2",
            "seed_oss",
            "mistral",
        ]
        | None
    ) = Field(None, description="split reasoning from chat content; none = raw text")
    adapter_path: str | None = Field(
        None,
        description="a LoRA adapter (PEFT or mlx-lm layout) loaded at start as policy version 1; every "
        "request of the base model uses it, as after an MLX-style /load_adapter",
    )


class ServerConfig(Section):
    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 = any free port)")
    api_key: str | None = Field(None, description="Bearer key required on every route but /health and /metrics")
    admin_api_key: str | None = Field(
        None, description="Bearer key required on admin routes (updates, pause, adapters)"
    )
    policy_wait_s: float = Field(
        0.0,
        ge=0,
        description="how long a request whose min_policy_version (or policy_version - max_off_policy_steps) "
        "is ahead of the server waits for an update before 409; per request: policy_wait_s",
    )
    max_off_policy_steps: int | None = Field(
        None,
        ge=0,
        description="a request carrying the trainer's policy_version starts only when the server is at most "
        "this many versions behind it (held for policy_wait_s, then 409)",
    )
    log_level: str = Field("info", description="uvicorn log level")
    allow_open_admin: bool = Field(
        False, description="serve admin routes (weights, adapters, pause) without admin_api_key on a non-loopback host"
    )
    max_upload_bytes: int = Field(1 << 30, ge=1, description="largest /upload_adapter body")
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="after SIGTERM: how long in-flight requests may run before they are aborted"
    )
    # request caps (over one: a 4xx naming the cap; docs/errors.md)
    max_body_bytes: int = Field(
        8 << 20, ge=1024, description="largest request body; bigger ones get 413 before they are read"
    )
    max_waiting_requests: int = Field(
        8192,
        ge=0,
        description="requests queued in the engine beyond which new ones get 429 with Retry-After (0 = no cap)",
    )
    enable_prompt_tokens_details: bool = Field(
        False,
        description="usage.prompt_tokens_details.cached_tokens (prefix-cache hits) in every answer; off: null, "
        "as vLLM's --enable-prompt-tokens-details",
    )
    enable_per_request_metrics: bool = Field(False, description="vLLM's per-request timing `metrics` in answers")
    enable_force_include_usage: bool = Field(False, description="usage on every stream chunk, whatever it asks")
    return_tokens_as_token_ids: bool = Field(False, description="logprob tokens as token_id:N in every answer")
    exclude_tools_when_tool_choice_none: bool = Field(False, description="tool_choice none: tools not rendered")
    max_stop_strings: int = Field(64, ge=0, description="most stop strings one request may send")
    max_stop_string_chars: int = Field(1024, ge=1, description="longest stop string")
    generate_max_tokens: int = Field(
        128, ge=1, description="max_tokens of an MLX-style /generate request that omits it (the MLX --max-tokens)"
    )
    metrics_format: Literal["prometheus", "json"] = Field(
        "prometheus",
        description="what a plain GET /metrics returns; an Accept header (Prometheus/OpenMetrics "
        "text or application/json) or ?format=json still picks per request. The MLX-style launch sets json",
    )
    trust_request_chat_template: bool = Field(
        False, description="accept a per-request chat_template (rendered sandboxed, bounded in time and size)"
    )
    root_path: str = Field(
        "", description="path prefix a path-based proxy serves this server under (ASGI root_path; vLLM --root-path)"
    )


class EngineConfig(Section):
    max_num_seqs: int = Field(256, ge=1, description="most sequences in one batch")
    max_num_batched_tokens: int = Field(2048, ge=16, description="token budget of one engine step")
    batch_window_ms: float = Field(
        0.0,
        ge=0,
        description="batch-forming window: when the engine is idle and a request arrives, admission "
        "waits up to this long (or until max_num_seqs sequences wait) before the first step; never while busy; "
        "0 = off (the MLX --flush-interval-ms)",
    )
    block_size: int = Field(16, ge=1, description="tokens per KV-cache block")
    kv_cache_bytes: int | None = Field(
        None, ge=1, description="KV-cache pool size in bytes; none = enough for max_num_seqs, capped by memory"
    )
    enable_prefix_caching: bool = Field(True, description="reuse KV of identical prompt prefixes")
    cascade_attention: bool = Field(
        True,
        description="CPU, without the C kernels: decode attention over a prefix shared by "
        "several sequences reads it once",
    )
    pack_weights: bool = Field(
        True,
        description="CPU: keep a second, packed copy of every projection's weight (fp32: MKL, 1.3-2.3x "
        "faster decode matmuls; bf16: oneDNN, 1.2-2x; batch-invariant mode: its own GEMM's panels, 1.1-1.2x, the "
        "same bits; costs the weights' size again in memory, and is skipped when that is more than half the "
        "available memory)",
    )
    cpu_kernels: bool = Field(
        True,
        description="CPU, fp32 or bf16: decode attention and the element-wise steps between matmuls run in C "
        "kernels (decode attention reads K/V where they lie in the paged cache), built with the "
        "machine's C compiler at first use; without one, PyTorch ops",
    )
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"] = Field(
        "raw_logprobs",
        description="raw_logprobs (vLLM's default) = log_softmax of the model's logits, before bias, penalties, "
        "temperature and top-k/top-p; processed_logprobs = of the distribution sampled from; *_logits = the "
        "values before log_softmax. raw and processed are accepted for the logprobs forms",
    )
    max_logprobs: int = Field(20, ge=-1, description="most top logprobs a request may ask for (-1 = no cap)")

    @field_validator("logprobs_mode", mode="before")
    @classmethod
    def _older_logprobs_mode_names(cls, value: object) -> object:
        return {"raw": "raw_logprobs", "processed": "processed_logprobs"}.get(value, value)  # type: ignore[call-overload]

    core_process: bool = Field(
        True, description="run the step loop in its own process (false: a thread of the HTTP server's process)"
    )
    core_start: Literal["fork", "spawn"] = Field(
        "fork",
        description="how the server starts that process, and that process its tensor-parallel workers: fork "
        "(Linux; the server imports torch and the engine first, so the processes import them once: ~4 s of CPU "
        "less per server, ~3.5 s per worker; spawn where forking is unsafe: CUDA initialised, threads running) "
        "or spawn (fresh interpreters)",
    )
    allow_forced_tokens: bool = Field(
        False, description="testing only: accept vllm_xargs.forced_token_ids (the first completion tokens)"
    )
    inflight_update_policy: str = Field(
        "keep",
        pattern=r"^(keep|recompute|abort|recompute_if_older_than:\d+)$",
        description="sequences in flight at a weight update: keep (go on over the old KV), recompute (their KV "
        "recomputed with the new weights first), abort (end with their tokens), recompute_if_older_than:N",
    )
    batch_invariant: bool = Field(
        False,
        description="a request's tokens and logprobs are bitwise the same alone or in any batch, chunked or "
        "prefix-cached (CPU, or CUDA through Triton kernels; tp=1, no expert parallelism; also "
        "VLLM_BATCH_INVARIANT=1 or --batch-invariant); "
        "see docs/batch-invariance.md",
    )


class RayRanksConfig(Section):
    """Written by a Ray deployment into the config of a server that spans nodes (engine/tp/ray_ranks.py)."""

    address: str = Field(description="the Ray cluster (its GCS address)")
    namespace: str = Field(description="the Ray namespace of the deployment's placement group")
    placement_group: str = Field(description="the placement group's name")
    bundles: list[int] = Field(description="the bundle of each tensor-parallel rank, rank 0's first")


class ParallelConfig(Section):
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per engine")
    dp: int = Field(1, ge=1, description="data-parallel engines behind the one API server")
    enable_expert_parallel: bool = Field(
        False,
        description="mixture-of-experts models: spread whole experts over the engine's ranks (each holds E/N) "
        "and send tokens to them with all-to-all, instead of splitting every expert (prime-rl, vLLM's name)",
    )
    enable_eplb: bool = Field(
        False, description="expert parallelism: re-place and replicate hot experts from their measured load"
    )
    eplb_step_interval: int = Field(3000, ge=1, description="enable_eplb: engine steps between rebalances")
    enable_dbo: bool = Field(
        False,
        description="expert parallelism: dual-batch overlap, two micro-batches per sparse layer so one's all-to-all "
        "runs while the other's experts compute (vLLM's --enable-dbo; see docs/expert-parallel.md for when it pays)",
    )
    eplb_num_redundant_experts: int = Field(
        0, ge=0, description="enable_eplb: extra expert slots in all, holding replicas of the hottest experts"
    )
    data_parallel_rank: int = Field(
        0, ge=0, description="expert parallelism over dp engines: this engine's index (its ranks are rank*tp..)"
    )
    data_parallel_address: str = Field("127.0.0.1", description="expert parallelism over dp engines: rendezvous host")
    data_parallel_rpc_port: int | None = Field(
        None, ge=1, le=65535, description="expert parallelism over dp engines: rendezvous port (engine 0 listens)"
    )
    data_parallel_size: int | None = Field(
        None,
        ge=1,
        description="expert parallelism over several servers (Wide-EP): the engines of the whole expert group, of "
        "which this server runs dp from data_parallel_start_rank on; none = dp (vLLM's --data-parallel-size with "
        "--data-parallel-size-local)",
    )
    data_parallel_start_rank: int = Field(0, ge=0, description="Wide-EP: this server's first engine's rank")
    oversubscribe_cpu: bool = Field(
        False,
        description="CPU: run tp * dp ranks even where they outnumber the cores (one torch thread each unless "
        "num_threads says otherwise), to try a many-rank shape such as prime-rl's 16-rank Wide-EP block on a small "
        "machine; slow",
    )
    expert_group_timeout_s: float = Field(
        120.0,
        gt=0,
        description="expert parallelism over dp engines: an engine waiting this long in one of the group's "
        "collectives (a peer gone or stuck) fails; a deployment restarts a Wide-EP group without waiting for it",
    )
    ray_ranks: RayRanksConfig | None = Field(
        None, description="set by a Ray deployment: where the ranks of a server spanning nodes run (not by hand)"
    )

    @property
    def data_parallel(self) -> bool:
        """The engines run behind the data-parallel client: several here, or this server's one engine of an expert
        group over servers (which takes its rank in the group from data_parallel_start_rank)."""
        return self.dp > 1 or self.data_parallel_size is not None

    @property
    def dp_total(self) -> int:
        """Engines in the expert group: this server's dp, or data_parallel_size across servers."""
        return self.data_parallel_size or self.dp


class GibberishDetectionConfig(Section):
    token_id_threshold: int = Field(100_000, ge=0, description="a sampled token is rare when its id is above this")
    logprob_offset: float = Field(
        2.0, description="... and gibberish when, also, its logprob is below -log(vocab_size) - logprob_offset"
    )


class RepetitionDetectionConfig(Section):
    window: int = Field(3000, ge=1, description="fire after this many consecutive confident tokens")
    prob_threshold: float = Field(
        0.99, gt=0, lt=1, description="a token is confident when the top probability exceeds this"
    )


class LogitsProcessorsConfig(Section):
    """prime-rl's rollout detectors (engine/detectors.py): a present section turns one on; when it
    fires the sequence ends with EOS, finish_reason "stop" and stop_reason naming it."""

    gibberish_detection: GibberishDetectionConfig | None = Field(
        None, description="end sequences that draw a rare token at high entropy"
    )
    repetition_detection: RepetitionDetectionConfig | None = Field(
        None, description="end sequences stuck in a confident repetition loop"
    )


class KVOffloadCPUConfig(Section):
    num_bytes: int = Field(..., ge=1, description="host memory for KV blocks evicted from the engine's pool")


class KVOffloadDiskConfig(Section):
    path: str = Field(
        ..., description="an existing, writable directory; blocks the CPU tier spills go to files under it"
    )
    num_bytes: int | None = Field(None, ge=1, description="cap on the disk tier's files; none = until the disk is full")


class KVMooncakeConfig(Section):
    """type = "mooncake" (docs/kv-mooncake.md): where the shared Mooncake store is."""

    master_address: str | None = Field(
        None,
        description="host:port of a running mooncake_master; none = rlserve starts one (a deployment: one "
        "for all its replicas) and stops it on exit",
    )
    metadata_server: str | None = Field(
        None,
        description="the transfer engine's metadata URL; none = the master's own HTTP metadata server "
        "(rlserve's master: filled in; a master of yours: http://<master host>:8080/metadata)",
    )
    local_hostname: str = Field("127.0.0.1", description="the address other replicas reach this one's memory on")
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="the transfer engine's transport")


class KVOffloadConfig(Section):
    type: Literal["native", "mooncake"] = Field(
        "native",
        description="the offload implementation: rlserve's own tiers, or one Mooncake store shared by "
        "every replica (cpu.num_bytes: the DRAM each replica contributes to it)",
    )
    cpu: KVOffloadCPUConfig | None = Field(None, description="the CPU tier (required)")
    disk: KVOffloadDiskConfig | None = Field(None, description="an optional disk tier behind the CPU tier")
    mooncake: KVMooncakeConfig | None = Field(None, description="type = 'mooncake': the store's addresses")

    @model_validator(mode="after")
    def _needs_cpu(self) -> KVOffloadConfig:
        if self.cpu is None:
            what = "a disk tier alone is not supported: " if self.disk is not None else ""
            raise ValueError(f"{what}kv_cache_offload needs a CPU tier: set kv_cache_offload.cpu.num_bytes")
        if self.mooncake is not None and self.type != "mooncake":
            raise ValueError(
                "kv_cache_offload.mooncake is set but kv_cache_offload.type is "
                f"{self.type!r}: set type = 'mooncake' or drop [kv_cache_offload.mooncake]"
            )
        if self.mooncake is not None and self.mooncake.metadata_server and not self.mooncake.master_address:
            raise ValueError(
                "kv_cache_offload.mooncake.metadata_server needs master_address too (rlserve starts "
                "its own master with its own metadata server)"
            )
        return self


class KVTransferConfig(Section):
    """Prefill/decode disaggregation (docs/disaggregation.md): this server serves the KV of requests it
    prefilled for a decode server (kv_transfer_params.do_remote_decode) and pulls KV from a prefill
    server (do_remote_prefill)."""

    host: str = Field("127.0.0.1", description="address the KV block server listens on and tells decode servers")
    port: int = Field(0, ge=0, le=65535, description="KV block server port; 0 = a free port")
    pin_timeout_s: float = Field(
        120.0, gt=0, description="a prefilled request's KV stays pinned this long for its decode server, at most"
    )
    pull_timeout_s: float = Field(
        60.0, gt=0, description="socket timeout of a decode server's pull; then it prefills itself"
    )
    non_cached_tokens: int = Field(
        0,
        ge=0,
        description="decode side: below this many prompt tokens missing from its own prefix cache, "
        "prefill locally instead of pulling",
    )
    peer_hosts: list[str] = Field(
        ["127.0.0.1", "::1", "localhost"],
        description="decode side: the prefill servers' hosts it may pull from; a request naming another "
        "remote_host is prefilled locally (a client cannot make this server connect elsewhere)",
    )


class Config(Section):
    seed: int = Field(0, description="seed of the engine's generator for unseeded requests")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="fraction of the device's memory (CPU: of the memory available at start) that weights plus "
        "the KV cache may use; sizes the KV pool when engine.kv_cache_bytes and memory_budget_bytes are not set",
    )
    memory_budget_bytes: int | None = Field(
        None, ge=1, description="cap on the KV-cache pool when engine.kv_cache_bytes is not set"
    )
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads; none = all cores")
    weight_version: str = Field("default", description="initial label of the served weights (trainer-owned)")
    weight_roots: list[str] = Field(
        default_factory=lambda: ["."],
        description="directories under which weight and adapter directories may be read (symlinks resolved)",
    )
    enable_return_routed_experts: bool = Field(
        False, description="MoE models: return each token's routed experts (routed_experts) on the generate routes"
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="environment variables set for every inference process (prime-rl's env_vars)"
    )
    logits_processors: LogitsProcessorsConfig = Field(default_factory=LogitsProcessorsConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    kv_cache_offload: KVOffloadConfig | None = Field(
        None, description="keep KV blocks evicted from the pool in CPU memory (and on disk); enables prefix caching"
    )
    kv_transfer: KVTransferConfig | None = Field(
        None,
        description="serve and pull KV blocks for prefill/decode disaggregation (set by deployment.type = "
        "'disaggregated'); enables prefix caching",
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        self.deployment._tp = self.parallel.tp
        check_combinations(self)
        if (
            self.kv_cache_offload is not None or self.kv_transfer is not None
        ) and not self.engine.enable_prefix_caching:
            self.engine.enable_prefix_caching = True  # the tiers and pulled KV sit behind the prefix cache
        return self


def warn_unapplied(config: Config, log: logging.Logger) -> None:
    """Settings read from prime-rl configs that this build accepts but does not act on yet (none today)."""
