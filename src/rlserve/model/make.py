"""Deterministic random-weight models written as ordinary Hugging Face directories.

`make_model` writes config.json, generation_config.json, model.safetensors and tokenizer files;
`default_model_dir` builds the embedded `tiny` model once into a cache folder and reuses it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# Bump whenever the generator's output changes; the default model's cache folder also carries a
# hash of this file (default_model_dir), so an edit here never reuses a stale build.
FORMAT_VERSION = 2
TOKENIZER_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Like Qwen3: single ids that are never split, but kept in the text when special tokens are
# skipped, so reasoning and tool-call parsers still see them in decoded output.
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# The rest of Qwen3's added tokens, so renderers written for Qwen3 (verifiers') accept this
# tokenizer. They take the ids just below the ones above, which stay where they were.
QWEN3_SPECIAL_TOKENS = ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                        "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN3_MARKUP_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                       "<|file_sep|>", "<tool_response>", "</tool_response>"]
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
# Tied embeddings: logits = embedding @ rms_normed_hidden, so their std is about
# embed_std * sqrt(hidden): peaked enough for stable greedy ties, flat enough to sample from.
LOGIT_STD = 6.0
# Scale of what o_proj/down_proj write into the residual stream. Well above the embedding's, so the
# last token's own embedding does not dominate its tied logit (greedy would then repeat it).
RESIDUAL_GAIN = 2 * LOGIT_STD
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json")

_COMMON = {
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
    "initializer_range": 0.02, "tie_word_embeddings": True, "use_cache": True, "rope_scaling": None,
}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
          "use_sliding_window": False, "sliding_window": None}
PRESETS: dict[str, dict] = {
    "tiny": {
        **_COMMON, **_QWEN3, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 4, "max_window_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": TOKENIZER_SIZE,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    },
    "smollm2-135m": {
        **_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5, "pretraining_tp": 1, "torch_dtype": "float32",
    },
    "qwen3-0.6b": {
        **_COMMON, **_QWEN3, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "max_window_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    },
}
_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "use_sliding_window": False,
              "sliding_window": None, "decoder_sparse_step": 1, "norm_topk_prob": True,
              "output_router_logits": False, "router_aux_loss_coef": 0.001}
PRESETS |= {
    # test size: 8 experts, top-2, one dense layer (mlp_only_layers) among the sparse ones
    "tiny-moe": {
        **_COMMON, **_QWEN3_MOE, "hidden_size": 128, "intermediate_size": 384, "moe_intermediate_size": 64,
        "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [2],
        "num_hidden_layers": 4, "max_window_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": TOKENIZER_SIZE,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    },
    # Qwen3-30B-A3B's routing (128 experts, top-8, renormalised) and vocabulary at a quarter of its
    # width and layers (0.54B parameters, 2.2 GB in fp32): what fits a 2-core benchmark next to a
    # transformers copy of itself, with the real experts-per-token and expert-grouping pattern
    "qwen3-30b-a3b-mini": {
        **_COMMON, **_QWEN3_MOE, "hidden_size": 512, "intermediate_size": 1536, "moe_intermediate_size": 192,
        "num_experts": 128, "num_experts_per_tok": 8, "mlp_only_layers": [],
        "num_hidden_layers": 12, "max_window_layers": 12, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    },
}
# Router logits with a std of 4: well-separated expert scores, so top-k picks never hang on
# float rounding (engine and transformers must pick the same experts)
ROUTER_GAIN = 4.0

# Qwen3's own ChatML template (hermes-style tools, <think> for the latest assistant turn).
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


_ADDED_TOKENS = [(QWEN3_SPECIAL_TOKENS, True), (QWEN3_MARKUP_TOKENS, False), (SPECIAL_TOKENS, True),
                 (MARKUP_TOKENS, False)]


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on CORPUS: any string round-trips, English compresses."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE - sum(len(tokens) for tokens, _ in _ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    for tokens, special in _ADDED_TOKENS:
        added = [AddedToken(t, special=special, normalized=False) for t in tokens]
        tok.add_special_tokens(added) if special else tok.add_tokens(added)
    assert tok.get_vocab_size() == TOKENIZER_SIZE, "CORPUS too small for the target vocabulary"
    return tok


def model_config(preset: str, tok: Tokenizer) -> dict:
    eot, eos = tok.token_to_id(PAD_TOKEN), tok.token_to_id(EOS_TOKEN)
    cfg = dict(PRESETS[preset], bos_token_id=eot, eos_token_id=eos, pad_token_id=eot)
    cfg["dtype"] = cfg["torch_dtype"]  # transformers 5 name; torch_dtype for older readers
    return cfg


def param_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes exactly as transformers' state_dict has them."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
        ]
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            shapes += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        shapes += [
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if _is_sparse(cfg, i):
            e_inter = cfg["moe_intermediate_size"]
            shapes.append((p + "mlp.gate.weight", (cfg["num_experts"], h)))
            for e in range(cfg["num_experts"]):
                x = f"{p}mlp.experts.{e}."
                shapes += [(x + "gate_proj.weight", (e_inter, h)), (x + "up_proj.weight", (e_inter, h)),
                           (x + "down_proj.weight", (h, e_inter))]
            continue
        shapes += [
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (cfg["vocab_size"], h)))
    return shapes


def _is_sparse(cfg: dict, layer: int) -> bool:
    """transformers' rule for which Qwen3-MoE layers hold experts."""
    return (cfg.get("num_experts", 0) > 0 and layer not in cfg.get("mlp_only_layers", [])
            and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)


def _init_tensor(name: str, shape: tuple[int, ...], hidden: int, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("mlp.gate.weight"):
        std = ROUTER_GAIN / math.sqrt(hidden)
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        std = LOGIT_STD / math.sqrt(hidden)
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        std = RESIDUAL_GAIN / math.sqrt(shape[1])
    else:
        std = 1.0 / math.sqrt(shape[1])
    # float64 sampling takes torch's scalar path: the same bits on every CPU, unlike float32's SIMD path.
    return torch.randn(shape, generator=gen, dtype=torch.float64).mul_(std).float()


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                       make: Iterator[torch.Tensor], metadata: dict[str, str]) -> None:
    """Write the header from shapes, then each tensor as it is made: memory peaks at one tensor."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, shape in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for (name, shape), tensor in zip(tensors, make, strict=True):
            assert tuple(tensor.shape) == shape, name
            f.write(tensor.to(dtype).contiguous().view(torch.uint8).numpy().data)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def _provenance(preset: str, seed: int) -> dict[str, str]:
    return {"format": "pt", "rlserve_preset": preset, "rlserve_seed": str(seed),
            "rlserve_format_version": str(FORMAT_VERSION)}


def _write_model(d: Path, preset: str, seed: int) -> None:
    tok = build_tokenizer()
    cfg = model_config(preset, tok)
    eot, eos = cfg["pad_token_id"], cfg["eos_token_id"]
    _write_json(d / "config.json", cfg)
    _write_json(d / "generation_config.json",
                {"bos_token_id": eot, "eos_token_id": [eos, eot], "pad_token_id": eot})
    tok.save(str(d / "tokenizer.json"))
    _write_json(d / "tokenizer_config.json", {
        # The generic fast class loads tokenizer.json as is; Qwen2Tokenizer would rebuild it with NFC.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": None,
        "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "split_special_tokens": False, "model_max_length": cfg["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(d / "special_tokens_map.json", {
        "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
        "additional_special_tokens": SPECIAL_TOKENS + QWEN3_SPECIAL_TOKENS})
    gen = torch.Generator().manual_seed(seed)
    shapes = param_shapes(cfg)
    tensors = (_init_tensor(n, s, cfg["hidden_size"], gen) for n, s in shapes)
    dtype = getattr(torch, cfg["torch_dtype"])
    _write_safetensors(d / "model.safetensors", shapes, dtype, tensors, _provenance(preset, seed))


def _is_complete(out: Path, expected: dict[str, str]) -> bool:
    """True if out already holds this exact model; raise if it holds something else."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    if not all((out / f).is_file() for f in MODEL_FILES):
        raise FileExistsError(f"{out} exists but is not a complete model directory; remove it "
                              "or choose another output path")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        found = f.metadata() or {}
    if found != expected:
        raise FileExistsError(f"{out} already holds a different model ({found}); remove it or "
                              "choose another output path")
    return True


def make_model(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a random-weight model for `preset` to out_dir (atomically) and return its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    out = Path(out_dir).expanduser()
    expected = _provenance(preset, seed)
    if _is_complete(out, expected):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_model(tmp, preset, seed)
        tmp.chmod(0o755)  # mkdtemp made it private; the model is meant to be shared
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process won the race: its directory is as good as ours.
            if not _is_complete(out, expected):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def cache_root() -> Path:
    """Where rlserve keeps what it builds: $RLSERVE_CACHE_DIR, or ~/.cache/rlserve."""
    return Path(os.environ.get("RLSERVE_CACHE_DIR") or Path.home() / ".cache" / "rlserve").expanduser()


def bench_cache_dir() -> Path:
    """Where benchmarks keep their models, per FORMAT_VERSION: make_model refuses a directory that holds
    another format's build, so a format change builds anew instead of failing on an old cache."""
    return cache_root() / "bench" / f"v{FORMAT_VERSION}"


def default_model_dir() -> Path:
    """The embedded tiny model, built once into $RLSERVE_CACHE_DIR (or ~/.cache/rlserve) under a
    name that changes with this file, so a changed generator never serves an old build."""
    return make_model("tiny", cache_root() / "models" / f"tiny-v{FORMAT_VERSION}-{generator_hash()}")


def generator_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def make_model_main(argv: list[str] | None = None) -> int:
    """`rlserve make-model --preset NAME --out DIR [--seed N]`."""
    parser = argparse.ArgumentParser(
        prog="rlserve make-model",
        description="Write a deterministic random-weight model as a Hugging Face directory.")
    parser.add_argument("--preset", required=True, choices=list(PRESETS))
    parser.add_argument("--out", required=True, type=Path, help="directory to create")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        print(make_model(args.preset, args.out, args.seed))
    except FileExistsError as e:
        parser.exit(1, f"rlserve make-model: error: {e}\n")
    return 0


# Varied plain English for the BPE merges; the tokenizer (and so every token id) depends on it.
CORPUS = """\
The morning train left the station a few minutes late, and most of the passengers did not seem to mind. A woman by the window was reading a thick paperback about the history of bridges, while two students argued quietly about whether their project would be finished before the weekend. Outside, the fields were still wet from the rain that had fallen through the night, and the light came in low and gold across the seats.

When the conductor walked through the carriage, he checked each ticket with a small nod. "Change at the next stop for the coast," he said to an older man who had asked twice already. The man thanked him, folded the ticket into his coat pocket, and went back to looking at the hills.

How to make a simple loaf of bread: mix five hundred grams of flour with ten grams of salt and seven grams of dried yeast. Add about three hundred and fifty millilitres of warm water and stir until there is no dry flour left. Knead the dough for ten minutes, until it feels smooth and springs back when you press it. Cover the bowl and leave it somewhere warm for an hour, or until the dough has doubled in size. Shape it, let it rise again for forty minutes, then bake at two hundred and twenty degrees for about thirty minutes. The loaf is done when it sounds hollow if you tap the bottom.

Question: What is the capital of France?
Answer: The capital of France is Paris.

Question: If a train travels 120 kilometres in 2 hours, what is its average speed?
Answer: Its average speed is 120 / 2 = 60 kilometres per hour.

Question: What is 17 + 25?
Answer: 17 + 25 = 42.

Let's think step by step. First, we need to find the total number of apples. There are 3 baskets with 12 apples each, so 3 * 12 = 36 apples. Then 8 apples are eaten, which leaves 36 - 8 = 28 apples. So the answer is 28.

We can check the result another way. If each of the 4 friends gets 7 apples, that is 4 * 7 = 28, which matches. Therefore the final answer is 28.

The user wants to know the weather in Berlin, so I should call the weather tool with the city name. After the tool returns, I will summarise the forecast in one or two sentences.

Scientists have long been interested in how birds find their way over thousands of kilometres. Some species seem to use the position of the sun during the day and the pattern of stars at night. Others appear to sense the magnetic field of the Earth, and many probably combine several cues at once. Young birds that migrate alone for the first time often follow a fixed direction for a fixed amount of time, which suggests that part of the route is inherited rather than learned.

In the small town where I grew up, the library was open only three days a week. On those days it was full of children doing homework, retired teachers reading newspapers, and people who simply wanted a quiet place to sit. The librarian knew everyone by name. She remembered which books you had borrowed, which ones you had returned late, and which ones you had pretended to read.

def fibonacci(n):
    # Return the first n Fibonacci numbers.
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


for i, value in enumerate(fibonacci(10)):
    print(f"{i}: {value}")

import json

with open("config.json") as f:
    config = json.load(f)
print(config["name"], config.get("version", "unknown"))

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "best hiking trails near the lake", "limit": 5}}
{"temperature": 18, "condition": "partly cloudy", "humidity": 0.64}

Dear team,

Thank you all for your hard work this quarter. We shipped the new version on time, fixed more than two hundred bugs, and reduced the average response time by almost half. I know that the last few weeks were demanding, and I want you to take some time to rest before we start planning the next release. Please send me your notes about what went well and what we should change by Friday.

Best regards,
Maria

Meeting notes, Tuesday:
- Review the draft budget for next year.
- Decide who will present the results at the conference in May.
- Agree on a new schedule for the weekly status call.
- Action items: Tom will update the document, Priya will contact the venue, and Alex will collect feedback from customers.

The river was wider than it looked from the road. We stood on the bank for a long time, watching the water move around the stones, before anyone suggested that we should try to cross. In the end we walked another mile upstream to a wooden bridge that an old farmer had told us about. It was narrow and a little unsteady, but it held, and by the afternoon we had reached the village on the other side.

There are many ways to learn a new language. Some people prefer classes with a teacher and a fixed plan, while others learn best by reading, listening to music, or talking with friends. Whatever method you choose, the most important thing is to practise a little every day. Even ten minutes of regular practice is better than a long session once a month.

Here is a short summary of the article. The authors measured the effect of sleep on memory in a group of sixty volunteers. Participants who slept for at least seven hours remembered significantly more words the next morning than those who stayed awake. The effect was strongest for words that had been learned just before going to bed.

A good answer is clear, correct, and no longer than it needs to be. If you are not sure about something, say so, and explain what would help you find out. When a question has several parts, answer each part in order. When a problem involves numbers, show the steps so that the reader can check them.

Monday, January 6: cold and bright, with a light wind from the north.
Wednesday, March 19: heavy rain in the morning, clearing in the evening.
Saturday, July 12: hot and humid, with a chance of thunder after four o'clock.
Thursday, October 30: foggy at first, then mild and sunny.

The price of the ticket is $24.99, or $19.99 if you book online at least a week in advance. Children under 12 travel free with an adult. Please keep your receipt, as you may be asked to show it during the journey.

She opened the door slowly. The room was exactly as she had left it ten years ago: the desk under the window, the shelves full of notebooks, the blue lamp with its crooked shade. Only the clock on the wall had stopped, at twenty past three, as if it had been waiting for her to come back.

To install the package, run the following command in your terminal:

    pip install example-package

Then import it in your code and create a client. If you see an error about a missing dependency, upgrade pip and try again. The documentation contains more examples, a list of all the options, and answers to common questions.

Error: file not found. Please check that the path is correct and that you have permission to read it.
Warning: the value of timeout is very low; some requests may fail.
Info: the server started on port 8000 and is ready to accept connections.

The history of mathematics is full of problems that looked simple but took centuries to solve. Some were answered with new ideas that changed whole fields, and others are still open today. A famous example is the question of whether every even number greater than two is the sum of two prime numbers. It has been checked for enormous numbers, yet no one has found a proof.

In the kitchen, the soup was almost ready. He tasted it, added a pinch of salt and some black pepper, and turned the heat down. The bread was still warm, the table was set for four, and through the window he could see his friends walking up the path, laughing about something he could not hear.

Frequently asked questions about the service:
Can I change my order after it has been placed? Yes, as long as it has not been shipped yet. Open your account, select the order, and choose the option to edit it.
How long does delivery take? Most orders arrive within three to five working days. Remote areas may take a little longer.
What happens if an item arrives damaged? Take a photograph of the damage, keep the packaging, and contact our support team. We will send a replacement or refund the full amount.

The museum is organised chronologically. The ground floor covers the ancient world, with pottery, coins, tools and jewellery from several civilisations. The first floor is devoted to medieval art and manuscripts, and the top floor holds paintings and sculpture from the last two centuries. Guided tours start every hour, and an audio guide is available in eight languages.

Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to produce glucose and oxygen. It takes place mainly in the leaves, inside structures called chloroplasts, which contain the pigment chlorophyll. The glucose provides energy for growth, while the oxygen is released into the air.

Good morning! I hope you slept well. Today we're going to talk about three things: why the experiment failed, what we learned from it, and how we'll design the next one. Please stop me at any point if something isn't clear; questions are welcome, and there are no silly ones.

Keyboard shortcuts: press Ctrl+S to save, Ctrl+Z to undo, and Ctrl+Shift+P to open the command palette. On a Mac, use Cmd instead of Ctrl.

SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name LIMIT 20;

The orchestra tuned their instruments while the audience found their seats. Then the lights dimmed, the conductor raised his baton, and for a moment the whole hall was perfectly silent.
"""
