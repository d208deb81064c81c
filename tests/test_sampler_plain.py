"""The sampler's C walk for plain rows (temperature 1 or greedy, nothing else; kernels/sample.c) draws
what the torch ops draw from the same uniforms, with the same logprobs, and leaves every other row to
them."""

import pytest
import torch

from rlserve.engine.sampler import Sampler, SamplingRow
from rlserve.model.cpu_kernels import cpu_kernels


def row(temperature: float = 1.0, seed: int | None = None, **fields) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    base = dict(top_k=0, top_p=1.0, min_p=0.0, num_logprobs=2, raw_logprobs=True, banned_ids=None)
    return SamplingRow(temperature=temperature, generator=gen, **(base | fields))


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels()
    assert k is not None, "the CPU kernels did not build"
    return k


def test_plain_rows_draw_what_the_torch_ops_draw(kernels):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(48, 49152, generator=gen) * 4  # peaked rows: the draw's walk crosses block edges
    logits[5, 1000:1024] = 30.0  # ties for the mode: greedy takes the first
    rows = [row(0.0 if i % 7 == 5 else 1.0, seed=i if i % 3 == 0 else None) for i in range(48)]
    fast = Sampler(torch.Generator().manual_seed(1), kernels)(logits.clone(), rows)
    rows = [row(0.0 if i % 7 == 5 else 1.0, seed=i if i % 3 == 0 else None) for i in range(48)]
    slow = Sampler(torch.Generator().manual_seed(1))(logits.clone(), rows)
    assert fast.token_ids == slow.token_ids
    assert fast.token_ids[5] == 1000
    assert [[i for i, _ in top] for top in fast.top_logprobs] == [[i for i, _ in top] for top in slow.top_logprobs]
    # as close to the exact value as torch's fp32 log_softmax (a unit in the last place of a log-sum-exp near 20)
    exact = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(fast.token_ids).unsqueeze(1)).squeeze(1)
    torch_fp32 = torch.log_softmax(logits, -1).gather(1, torch.tensor(fast.token_ids).unsqueeze(1)).squeeze(1)
    bound = max((torch_fp32.double() - exact).abs().max().item(), 2e-6)
    assert (torch.tensor(fast.logprobs).double() - exact).abs().max().item() <= bound


def test_any_other_row_keeps_the_torch_ops(kernels, monkeypatch):
    calls = []
    original = Sampler._sample_plain
    monkeypatch.setattr(Sampler, "_sample_plain", lambda self, *a: calls.append(1) or original(self, *a))
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(2))
    sampler = Sampler(torch.Generator().manual_seed(1), kernels)
    sampler(logits.clone(), [row(), row()])
    assert calls == [1]
    for other in (
        dict(temperature=0.7),
        dict(top_k=5),
        dict(top_p=0.9),
        dict(logit_bias={3: 1.0}),
        dict(banned_ids=[2]),
        dict(forced_id=4),
    ):
        fields = {"temperature": 1.0} | other
        sampler(logits.clone(), [row(), row(**fields)])
        assert calls == [1], other


def test_a_raw_logprob_has_the_same_bits_on_either_path(kernels):
    """A plain row batched with a row the torch ops must take (temperature 0.7) goes their way too; its
    token and raw logprobs are still the ones the C walk gives it alone."""
    logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(3)) * 3
    alone = Sampler(torch.Generator().manual_seed(1), kernels)(logits[:1].clone(), [row(seed=11)])
    mixed = Sampler(torch.Generator().manual_seed(1), kernels)(logits.clone(), [row(seed=11), row(0.7, seed=12)])
    assert mixed.token_ids[0] == alone.token_ids[0]
    assert mixed.logprobs[0] == alone.logprobs[0] and mixed.top_logprobs[0] == alone.top_logprobs[0]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.01},
        {"logit_bias": {3: 1.0}, "banned_ids": [2]},
        {"forced_id": 4},
        {"penalties": (1.2, 0.5, 0.3, [1, 2, 3], [3, 4, 4])},
        {"raw_logprobs": False, "temperature": 0.5},
    ],
    ids=["plain", "greedy", "filters", "bias-banned", "forced", "penalties", "processed"],
)
def test_float64_logits_are_sampled_in_float64(kernels, fields):
    """A float64 (reference) engine's logits: every option applies in float64, the C walk (float32) is left
    out, and the logprobs are float64's, which float32's agree with to its precision."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3

    def sample(x):
        return Sampler(torch.Generator().manual_seed(1), kernels)(x, [row(**fields, seed=s) for s in range(3)])

    wide, narrow = sample(logits.clone()), sample(logits.float())
    assert wide.token_ids == narrow.token_ids
    assert torch.allclose(torch.tensor(wide.logprobs), torch.tensor(narrow.logprobs), atol=1e-5)
    if fields == {}:  # float64's value, out of float32's reach
        exact = torch.log_softmax(logits, -1).gather(1, torch.tensor(wide.token_ids).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(wide.logprobs, dtype=torch.float64), exact, rtol=0, atol=1e-12)
