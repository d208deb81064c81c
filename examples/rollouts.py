"""GRPO-style rollouts against a running rlserve: a group of samples per prompt, a toy reward,
group-normalised advantages, and the padded batch a trainer would consume.

    rlserve serve                      # in another shell; listens on 127.0.0.1:8000
    python examples/rollouts.py [--base-url http://127.0.0.1:8000[,http://host2:8000]]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import torch

from rlserve.client import InferenceClient, Sample, build_training_batch

PROMPTS = [
    "Write a haiku about the sea.",
    "What is 17 * 23?",
    "Name three prime numbers.",
    "Say hello in French.",
]


def reward(sample: Sample) -> float:
    """Toy reward: longer answers (in characters) score higher."""
    return float(len(sample.text))


def group_advantages(rewards: list[float]) -> list[float]:
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


async def rollout(client: InferenceClient, prompt: str, group: int, group_size: int, max_tokens: int) -> list[Sample]:
    messages = [{"role": "user", "content": prompt}]
    # one session per trajectory: a multi-turn episode would keep hitting the same replica's prefix cache
    return await asyncio.gather(
        *(
            client.chat(messages, max_tokens=max_tokens, temperature=1.0, session_id=f"group{group}-sample{k}")
            for k in range(group_size)
        )
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="one URL or several, comma-separated")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    async with InferenceClient(args.base_url.split(",")) as client:
        groups = await asyncio.gather(
            *(rollout(client, p, g, args.group_size, args.max_tokens) for g, p in enumerate(PROMPTS))
        )

    samples = [s for group in groups for s in group]
    advantages = [a for group in groups for a in group_advantages([reward(s) for s in group])]
    batch = build_training_batch(samples)

    print(f"{len(PROMPTS)} prompts x {args.group_size} samples = {len(samples)} samples")
    for name in ("input_ids", "attention_mask", "loss_mask", "logprobs", "policy_versions"):
        print(f"  {name:16s} {tuple(getattr(batch, name).shape)}")
    first = samples[0]
    print(
        f"sample 0: prompt ids {first.prompt_ids[:6]}... ({len(first.prompt_ids)}), "
        f"completion ids {first.completion_ids[:6]}... ({len(first.completion_ids)})"
    )
    print(f"  logprobs {[round(x, 3) for x in first.logprobs[:6]]}")
    print(f"  text {first.text!r}")
    print(f"policy versions {batch.policy_versions.tolist()}")
    print(f"rewards    {[reward(s) for s in samples]}")
    print(f"advantages {[round(a, 2) for a in advantages]}")
    # a trainer weights each completion token by its sample's advantage; batch.logprobs is the old policy
    token_advantages = torch.tensor(advantages)[:, None] * batch.loss_mask
    print(f"token advantages {tuple(token_advantages.shape)} over {int(batch.loss_mask.sum())} completion tokens")


if __name__ == "__main__":
    asyncio.run(main())
