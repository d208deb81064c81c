"""The whole config tree. Loading from files and CLI overrides lives in `config_loader`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    name: str | None = Field(None, description="HF model directory or hub id; none = the embedded default model")
    max_model_len: int | None = Field(None, ge=2, description="context length; none = the model's own")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto = float32 on CPU (exact against an fp32 trainer), bfloat16 on CUDA; bfloat16 on "
        "CPU is the fast path where the CPU has native bf16 (AVX512_BF16 or AMX)",
    )
    lm_head_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of the LM head and the logits after it (log_softmax and sampling are always "
        "float32); auto = float32, which for a bf16 model costs a float32 copy of the head weight and "
        "keeps logprobs close to an fp32 forward; set it to the model dtype to run the head in that",
    )
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N or mps")
    enforce_eager: bool = Field(False, description="never capture CUDA graphs")
    trust_remote_code: bool = Field(False, description="allow custom code from the model directory")
    chat_template: str | None = Field(None, description="a Jinja chat template (file path or inline) replacing the model's")
    served_model_name: str | None = Field(None, description="the name clients use; default = model.name")
    tool_call_parser: Literal["hermes", "llama3_json", "llama4_json", "mistral"] | None = Field(
        None, description="parse tool calls out of chat output when a request has tools; none = raw text"
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None, description="split <think> reasoning from chat content; none = raw text"
    )


class ServerConfig(Section):
    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 = any free port)")
    api_key: str | None = Field(None, description="Bearer key required on every route but /health and /metrics")
    admin_api_key: str | None = Field(None, description="Bearer key required on admin routes (updates, pause, adapters)")
    log_level: str = Field("info", description="uvicorn log level")


class EngineConfig(Section):
    max_num_seqs: int = Field(256, ge=1, description="most sequences in one batch")
    max_num_batched_tokens: int = Field(2048, ge=16, description="token budget of one engine step")
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
        "faster decode matmuls; bf16: oneDNN, 1.2-2x; costs the weights' size again in memory, and is "
        "skipped when that is more than half the available memory)",
    )
    cpu_kernels: bool = Field(
        True,
        description="CPU, fp32 or bf16: decode attention and the element-wise steps between matmuls run in C "
        "kernels (decode attention reads K/V where they lie in the paged cache), built with the "
        "machine's C compiler at first use; without one, PyTorch ops",
    )
    logprobs_mode: Literal["processed", "raw"] = Field(
        "processed", description="processed = the distribution sampled from; raw = log_softmax of the logits"
    )
    max_logprobs: int = Field(20, ge=-1, description="most top logprobs a request may ask for (-1 = no cap)")
    allow_forced_tokens: bool = Field(
        False, description="testing only: accept vllm_xargs.forced_token_ids (the first completion tokens)"
    )


class Config(Section):
    seed: int = Field(0, description="seed of the engine's generator for unseeded requests")
    memory_budget_bytes: int | None = Field(
        None, ge=1, description="cap on the KV-cache pool when engine.kv_cache_bytes is not set"
    )
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads; none = all cores")
    weight_version: str = Field("default", description="initial label of the served weights (trainer-owned)")
    weight_roots: list[str] = Field(
        default_factory=lambda: ["."],
        description="directories under which weight and adapter directories may be read (symlinks resolved)",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)

    @model_validator(mode="after")
    def _check_combinations(self) -> "Config":
        if self.model.max_model_len is not None and self.engine.max_num_batched_tokens < self.engine.block_size:
            raise ValueError("engine.max_num_batched_tokens must be at least engine.block_size")
        return self
