"""Qwen3-MoE (tiny-moe) against transformers, and router replay: the experts the engine reports
are the ones transformers' router picks, wherever the token's KV came from, and forcing a
transformers forward onto them reproduces the engine's logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.engine.routing import encode_routed_experts
from rlserve.engine.weights import stage, stage_from_dir
from rlserve.model.lora import AdapterError, load_peft_adapter
from rlserve.model.make import make_model
from test_engine import assert_matches_hf, hf_logprobs, random_prompts


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_model("tiny-moe", root / "base", seed=0), make_model("tiny-moe", root / "next", seed=1)


@pytest.fixture(scope="module")
def model_dir(dirs):
    return dirs[0]


def moe_engine(model_dir, replay: bool = True, **engine) -> Engine:
    cfg = Config()
    cfg.model.name, cfg.model.max_model_len = str(model_dir), engine.pop("max_model_len", 512)
    cfg.engine.kv_cache_bytes = engine.pop("kv_cache_bytes", 8 << 20)
    cfg.enable_return_routed_experts = replay
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    return Engine(cfg)


@pytest.fixture(scope="module")
def engine(model_dir):
    return moe_engine(model_dir)


def hf_experts(hf, ids: list[int]) -> np.ndarray:
    """transformers' router choices (top-k, best first) at every position: [T, MoE layers, k]."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    return torch.stack([r.float().softmax(-1).topk(k, -1).indices for r in out.router_logits], 1).numpy()


def assert_routing_matches(hf, prompt, comp):
    forwarded = (prompt + comp.token_ids)[:-1]  # the last sampled token is never forwarded
    assert comp.routed_experts.shape == (len(forwarded), 3, 2)  # layer 2 is dense (mlp_only_layers)
    assert comp.routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(comp.routed_experts, hf_experts(hf, forwarded))


def test_shape_and_sparse_layers(engine):
    moe = engine.shape.moe
    assert (moe.num_experts, moe.top_k, moe.sparse_layers, moe.norm_topk_prob) == (8, 2, (0, 1, 3), True)


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_greedy_and_logprobs_match_transformers(model_dir, hf, cpu_kernels):
    engine = moe_engine(model_dir, replay=False, cpu_kernels=cpu_kernels)
    prompts = random_prompts(6, engine.vocab_size, seed=3)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0))
    assert_matches_hf(hf, prompts, outs)
    assert outs[0].outputs[0].routed_experts is None  # replay off


def test_sampled_logprobs_and_routing_match_transformers(engine, hf):
    prompts = random_prompts(4, engine.vocab_size, lo=20, hi=50, seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0, seed=5, n=3)
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        for comp in out.outputs:  # n > 1 siblings share the prompt's blocks and their routing
            lp = hf_logprobs(hf, prompt, comp.token_ids).gather(1, torch.tensor(comp.token_ids).unsqueeze(1)).squeeze(1)
            assert torch.allclose(torch.tensor(comp.logprobs), lp, atol=1e-4)
            assert_routing_matches(hf, prompt, comp)


def test_prefix_cache_served_positions_report_their_experts(engine, hf):
    prompt = random_prompts(1, engine.vocab_size, lo=70, hi=70, seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.generate([prompt], params)
    longer = prompt + [7, 8, 9]
    (out,) = engine.generate([longer], params)
    assert out.num_cached_tokens == 64  # four blocks computed by the first request
    assert_routing_matches(hf, longer, out.outputs[0])


def test_preempted_then_resumed_sequences_report_every_position(model_dir, hf):
    # 8 blocks of 16 tokens for four sequences that each grow to 5 blocks: decodes must preempt
    engine = moe_engine(model_dir, kv_cache_bytes=8 * 16 * 2048, max_model_len=128)
    prompts = random_prompts(4, engine.vocab_size, lo=30, hi=30, seed=17)
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, logprobs=0, seed=3))
    assert engine.stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        lp = hf_logprobs(hf, prompt, comp.token_ids).gather(1, torch.tensor(comp.token_ids).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(comp.logprobs), lp, atol=1e-4)
        assert_routing_matches(hf, prompt, comp)


def test_blocks_back_from_the_offload_tier_bring_their_experts(model_dir, hf):
    from rlserve.config.schema import KVOffloadConfig

    cfg = Config()
    cfg.model.name, cfg.model.max_model_len, cfg.engine.kv_cache_bytes = str(model_dir), 128, 8 * 16 * 2048
    cfg.enable_return_routed_experts = True
    cfg.kv_cache_offload = KVOffloadConfig.model_validate({"cpu": {"num_bytes": 32 * 16 * 2048}})
    engine = Engine(cfg)
    prompts = random_prompts(4, engine.vocab_size, lo=70, hi=70, seed=18)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.generate(prompts, params)  # each evicts the blocks of the one before into the CPU tier
    (out,) = engine.generate([prompts[0] + [7, 8]], params)
    assert engine.stats.kv_offload_cpu_hits > 0
    assert_routing_matches(hf, prompts[0] + [7, 8], out.outputs[0])
    engine.close()


def _replay_router(router, experts: torch.Tensor):
    """A transformers router that takes the given experts instead of its own top-k (what a
    trainer does with routed_experts); weights still come from its softmax."""

    def forward(hidden):
        logits = F.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
        weights = logits.float().softmax(-1).gather(1, experts)
        if router.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts

    return forward


def test_forcing_the_returned_experts_reproduces_the_logprobs(engine, model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = random_prompts(1, engine.vocab_size, lo=30, hi=30, seed=8)[0]
    (out,) = engine.generate(
        [prompt], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=0, seed=9)
    )
    comp = out.outputs[0]
    routers = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]

    def replayed_logprobs(rows: np.ndarray) -> torch.Tensor:
        for i, router in enumerate(routers):
            router.forward = _replay_router(router, torch.from_numpy(rows[:, i].astype(np.int64)))
        try:
            with torch.no_grad():
                logits = hf(torch.tensor([(prompt + comp.token_ids)[:-1]])).logits[0, len(prompt) - 1 :]
        finally:
            for router in routers:
                del router.forward
        return logits.log_softmax(-1).gather(1, torch.tensor(comp.token_ids).unsqueeze(1)).squeeze(1)

    assert torch.allclose(replayed_logprobs(comp.routed_experts), torch.tensor(comp.logprobs), atol=1e-4)
    # and routing matters: other experts give other logprobs
    shifted = (comp.routed_experts.astype(np.int64) + 1) % 8
    assert not torch.allclose(replayed_logprobs(shifted), torch.tensor(comp.logprobs), atol=1e-2)


def test_encoding_is_raw_little_endian_rows_from_start():
    rows = np.arange(5 * 3 * 2, dtype=np.uint8).reshape(5, 3, 2)
    enc = encode_routed_experts(rows, 2)
    assert enc["shape"] == [3, 3, 2] and enc["start"] == 2 and enc["dtype"] == "uint8"
    import base64

    assert base64.b64decode(enc["data"]) == rows[2:].tobytes()
    wide = encode_routed_experts(rows.astype(np.uint16) * 20, 0)
    assert wide["dtype"] == "uint16"
    assert (
        np.frombuffer(base64.b64decode(wide["data"]), "<u2").reshape(wide["shape"]).tolist()
        == (rows.astype(np.uint16) * 20).tolist()
    )


def test_dense_model_refuses_router_replay(tmp_path):
    cfg = Config()
    cfg.enable_return_routed_experts = True
    with pytest.raises(ValueError, match="mixture-of-experts"):
        Engine(cfg)


def test_expert_weights_update_from_disk_and_from_a_trainer_push(dirs):
    base, nxt = dirs
    engine = moe_engine(base)
    prompts = random_prompts(3, engine.vocab_size, seed=10)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    engine.commit_weights(stage_from_dir(engine.model, nxt))
    hf_next = AutoModelForCausalLM.from_pretrained(nxt, dtype=torch.float32).eval()
    outs = engine.generate(prompts, greedy)
    assert_matches_hf(hf_next, prompts, outs)
    for prompt, out in zip(prompts, outs):
        assert_routing_matches(hf_next, prompt, out.outputs[0])
    # a transformers 5 trainer pushes its in-memory tensors: experts stacked [E, 2I, H] / [E, H, I]
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    named = [(n, p.detach()) for n, p in hf_base.named_parameters()]
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in named)
    engine.commit_weights(stage(engine.model, named, "push", require_all=False))
    assert engine.policy_version == 2
    outs = engine.generate(prompts, greedy)
    assert_matches_hf(hf_base, prompts, outs)
    assert_routing_matches(hf_base, prompts[0], outs[0].outputs[0])


def test_lora_on_attention_matches_peft_and_expert_lora_is_refused(model_dir, hf, tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(11)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, cfg).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    engine = moe_engine(model_dir)
    engine.add_adapter(load_peft_adapter("a", tmp_path / "adapter", engine.shape, engine.dtype, engine.device))
    prompts = random_prompts(2, engine.vocab_size, seed=12)
    for i, prompt in enumerate(prompts):
        engine.add_request(
            str(i),
            prompt,
            SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0, seed=i),
            adapter="a",
        )
    outs = {}
    while engine.has_unfinished():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    for i, prompt in enumerate(prompts):
        comp = outs[str(i)].outputs[0]
        lp = (
            hf_logprobs(peft_model, prompt, comp.token_ids)
            .gather(1, torch.tensor(comp.token_ids).unsqueeze(1))
            .squeeze(1)
        )
        assert torch.allclose(torch.tensor(comp.logprobs), lp, atol=1e-4)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"] = torch.zeros(128, 4)
    save_file(tensors, tmp_path / "adapter" / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="mixture-of-experts layer"):
        load_peft_adapter("b", tmp_path / "adapter", engine.shape, engine.dtype, engine.device)
