"""The sampler runs small batches of logits on one thread (SINGLE_THREAD_LOGITS): same tokens and
logprobs as on the configured threads, and the thread count is left as it was."""

import torch

from rlserve.engine.sampler import SINGLE_THREAD_LOGITS, Sampler, SamplingRow


def row(seed: int) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed)
    return SamplingRow(
        temperature=0.8,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        generator=gen,
        num_logprobs=2,
        raw_logprobs=False,
        banned_ids=None,
    )


def test_small_batches_sample_the_same_on_one_thread_and_restore_the_thread_count():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(0)) * 3
        assert logits.numel() < SINGLE_THREAD_LOGITS
        got = Sampler(torch.Generator().manual_seed(1))(logits.clone(), [row(7)])
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        want = Sampler(torch.Generator().manual_seed(1))(logits.clone(), [row(7)])
        assert got == want
        # a large batch keeps the configured threads
        torch.set_num_threads(2)
        big = torch.randn(4, SINGLE_THREAD_LOGITS // 2, generator=torch.Generator().manual_seed(2))
        Sampler(torch.Generator().manual_seed(1))(big, [row(i) for i in range(4)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
