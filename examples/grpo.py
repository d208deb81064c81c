"""GRPO through rlserve, end to end: rollouts with exact logprobs, rewards, an AdamW step, new
weights pushed into the server, repeat. Small enough for a laptop CPU.

    python examples/grpo.py --steps 40 --out runs/grpo          # starts its own rlserve
    python examples/grpo.py --async-steps 1 --out runs/grpo-async  # next rollouts overlap the step
    python examples/grpo.py --update-from-disk                   # push through safetensors files
    python examples/grpo.py --hold-back --out runs/grpo-held      # rollouts queued two steps ahead, held by the server
    python examples/grpo.py --exact --dtype bfloat16 --out runs/exact  # true on-policy: mismatch KL exactly 0.0
    python examples/grpo.py --compare-exact --dtype bfloat16 --out runs/cmp  # reward vs step, --exact on and off

The task: "answer with words that start with a vowel". The reward is the share of the first
--max-tokens completion tokens that are such words, in [0, 1]; the embedded model starts near 0.2.
Each step samples --group-size completions per prompt, normalises rewards within each group, and
takes one clipped-ratio policy-gradient step against rlserve's sampling logprobs. The trainer
recomputes those logprobs with transformers (fp32) and reports the mismatch: on the same weights
it is zero up to float rounding.

--exact is true on-policy RL: the server runs in batch-invariant mode and the trainer's model is
patched by `rlserve.train.patch`, so both compute the same numerics and the mismatch KL printed at
every step is exactly 0.0, in float32 and in bfloat16 (--dtype). --compare-exact runs the loop with
--exact off, then on, and plots both rewards against the step (DIR/exact-vs-default.png).

--hold-back is the one-step off-policy pattern with the server doing the admission control: rollouts are
submitted two steps ahead, each carrying the trainer step that will consume it as `policy_version`, and
the server (started with max_off_policy_steps 1) holds a request until it serves at most one version
behind that step, instead of refusing it. The plot's third panel is the histogram of the samples'
staleness (trainer version at the step that trains on them minus the version that sampled them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlserve.client import Sample, SyncInferenceClient, TrainingBatch, build_training_batch
from rlserve.runtime.ports import free_port

TOPICS = [
    "animals",
    "the sea",
    "music",
    "colors",
    "food",
    "weather",
    "cities",
    "games",
    "trees",
    "space",
    "rivers",
    "books",
    "tools",
    "birds",
    "sports",
    "fruit",
]
VOWEL_WORD = re.compile(r" [aeiou][a-z]*")


@dataclass
class StepMetrics:
    step: int
    reward_mean: float
    mismatch_kl: float
    max_abs_logprob_diff: float
    policy_version: int  # the version every sample of this step came from
    expected_policy_version: int
    staleness_mean: float  # trainer version at the step minus the samples' version
    staleness_max: int
    loss: float
    clip_fraction: float
    completion_tokens: int
    rollout_s: float
    rollout_tokens_per_s: float
    train_s: float
    push_s: float
    step_s: float
    held_requests: int = 0  # requests sent before the server had a version they may start on
    staleness_histogram: list[int] = field(default_factory=list)  # samples per staleness 0, 1, ...


class VowelTask:
    """Prompts and a verifiable reward, scored on token ids (no text round trip)."""

    def __init__(self, tokenizer, max_tokens: int):
        vocab = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        self.good = {i for i, text in enumerate(vocab) if VOWEL_WORD.fullmatch(text)}
        self.max_tokens = max_tokens

    def prompt(self, i: int) -> list[dict[str, str]]:
        topic = TOPICS[i % len(TOPICS)]
        return [{"role": "user", "content": f"Say something about {topic}, using only words that start with a vowel."}]

    def reward(self, sample: Sample) -> float:
        return sum(t in self.good for t in sample.completion_ids[: self.max_tokens]) / self.max_tokens


# ---- the server ---------------------------------------------------------------------------------


def start_server(model_dir: Path, weight_root: Path, extra: tuple[str, ...] = ()) -> tuple[str, subprocess.Popen, Path]:
    log = Path(tempfile.mkstemp(prefix="grpo-rlserve-", suffix=".log")[1])
    cmd = [
        sys.executable,
        "-m",
        "rlserve.cli",
        "serve",
        "--server.host",
        "127.0.0.1",
        "--server.port",
        "0",
        "--model.name",
        str(model_dir),
        "--model.max_model_len",
        "512",
        "--engine.kv_cache_bytes",
        str(64 << 20),
        "--weight_roots",
        json.dumps([str(weight_root)]),
        *extra,
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rlserve exited with code {proc.returncode}:\n{log.read_text()}")
        match = re.search(r"rlserve: serving \S+ on (http://\S+)", log.read_text(errors="replace"))
        if match:
            return match.group(1), proc, log
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"rlserve did not start within 300 s:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- rollouts -----------------------------------------------------------------------------------


def rollout(
    client: SyncInferenceClient,
    pool: ThreadPoolExecutor,
    prompts: list[list[int]],
    args,
    min_version: int | None,
    step: int,
    trainer_version: int | None = None,
) -> tuple[list[list[Sample]], float]:
    """One group per prompt, all groups in flight at once; returns (groups, seconds)."""
    start = time.perf_counter()
    futures = [
        pool.submit(
            client.generate_group,
            token_ids=ids,
            n=args.group_size,
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=args.seed * 1_000_003 + step * 1009 + i,
            return_text=False,
            min_policy_version=min_version,
            policy_version=trainer_version,  # --hold-back: the server admits it at most one version behind
            session_id=f"step{step}-prompt{i}",
        )
        for i, ids in enumerate(prompts)
    ]
    return [f.result() for f in futures], time.perf_counter() - start


def group_advantages(rewards: list[float]) -> list[float]:
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-4) for r in rewards]


# ---- the trainer --------------------------------------------------------------------------------


def token_logprobs(model, batch: TrainingBatch, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for every position, fp32; [batch, time-1]."""
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    if params is None:
        logits = model(**inputs).logits
    else:  # the snapshot that produced a stale batch
        logits = torch.func.functional_call(model, params, args=(), kwargs=inputs).logits
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


def exact_token_logprobs(model, batch: TrainingBatch, samples: list[Sample]) -> torch.Tensor:
    """token_logprobs' layout from rlserve.train.token_logprobs (the sampler's own formula); 0 off the completions."""
    from rlserve.train import token_logprobs as exact

    per_sample = exact(model, [s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    rows = []
    for s, lp in zip(samples, per_sample, strict=True):
        before = torch.zeros(len(s.prompt_ids) - 1)
        after = torch.zeros(batch.input_ids.shape[1] - len(s.prompt_ids) - len(lp))
        rows.append(torch.cat((before, lp, after)))
    return torch.stack(rows)


def train_step(
    model,
    optimizer,
    batch: TrainingBatch,
    advantages: torch.Tensor,
    args,
    sampler_params: dict[str, torch.Tensor] | None,
    samples: list[Sample] | None = None,
) -> dict[str, float]:
    """One GRPO step: token-mean clipped surrogate with rlserve's logprobs as the old policy."""
    mask = batch.loss_mask[:, 1:]
    old = batch.logprobs[:, 1:]
    new = exact_token_logprobs(model, batch, samples) if args.exact else token_logprobs(model, batch)
    with torch.no_grad():
        # the trainer's view of the policy that sampled: the same weights the server had
        ref = new.detach() if sampler_params is None else token_logprobs(model, batch, sampler_params)
        diff = (ref - old) * mask
        mismatch_kl = float(((diff.exp() - 1 - diff) * mask).sum() / mask.sum())
        max_diff = float(diff.abs().max())
    ratio = (new - old).exp()
    adv = advantages[:, None]
    clipped = ratio.clamp(1 - args.clip, 1 + args.clip)
    loss = -(torch.min(ratio * adv, clipped * adv) * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    clip_fraction = float((((ratio - clipped).abs() > 0) * mask).sum() / mask.sum())
    return {
        "loss": loss.item(),
        "mismatch_kl": mismatch_kl,
        "max_abs_logprob_diff": max_diff,
        "clip_fraction": clip_fraction,
    }


class Pusher:
    """New weights into the server: a gloo/NCCL broadcast (default) or safetensors files on disk."""

    def __init__(self, client: SyncInferenceClient, url: str, weight_root: Path, from_disk: bool):
        self.client, self.weight_root, self.from_disk = client, weight_root, from_disk
        self.broadcaster = None
        if not from_disk:
            from rlserve.client import WeightBroadcaster

            self.broadcaster = WeightBroadcaster([url], "127.0.0.1", free_port())
            self.broadcaster.connect()

    def push(self, model, step: int) -> int:
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        if self.broadcaster is not None:
            (version,) = self.broadcaster.push(named, weight_version=f"step-{step}")
            return version
        step_dir = self.weight_root / f"step-{step}"
        step_dir.mkdir(parents=True)
        save_file({n: t.contiguous() for n, t in named}, str(step_dir / "model.safetensors"))
        (version,) = self.client.update_weights(str(step_dir), pause_mode=None, weight_version=f"step-{step}").values()
        old = self.weight_root / f"step-{step - 1}"
        if old.is_dir():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        return version

    def close(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()


# ---- the loop -----------------------------------------------------------------------------------


def train(args) -> list[StepMetrics]:
    from rlserve.model.make import default_model_dir

    torch.manual_seed(args.seed)
    model_dir = Path(args.model) if args.model else default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model.train()
    serving = ("--model.dtype", args.dtype)
    if args.exact:
        from rlserve.train import patch

        patch(model)  # the forward of rlserve's batch-invariant mode, over this model's parameters
        serving += ("--engine.batch_invariant", "true")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    task = VowelTask(tokenizer, args.max_tokens)
    out = Path(args.out) if args.out else None
    if out:
        require_matplotlib()  # before training, not after it: the plot is written at the end
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("")

    weight_root = Path(tempfile.mkdtemp(prefix="grpo-weights-", dir=args.weights_dir))
    admission = ("--server.max_off_policy_steps", "1", "--server.policy_wait_s", "600") if args.hold_back else ()
    url, proc, log = (
        (args.base_url, None, None) if args.base_url else start_server(model_dir, weight_root, admission + serving)
    )
    client = SyncInferenceClient([url])
    # --hold-back: two steps' rollouts at once (one running, one held by the server)
    pool = ThreadPoolExecutor(max_workers=args.prompts_per_step * (2 if args.hold_back else 1))
    ahead = ThreadPoolExecutor(max_workers=2 if args.hold_back else 1)  # the next steps' rollouts
    pusher = None
    history: list[StepMetrics] = []
    try:
        pusher = Pusher(client, url, weight_root, args.update_from_disk)
        version = next(iter(client.metrics().values()))["current_policy_version"]
        prompt_ids = [client.tokenize(messages=task.prompt(i)) for i in range(len(TOPICS))]

        def prompts_for(step: int) -> list[list[int]]:
            return [
                prompt_ids[(step * args.prompts_per_step + i) % len(prompt_ids)] for i in range(args.prompts_per_step)
            ]

        snapshot = None  # weights of the policy that sampled the pending batch (async only)
        snapshots: dict[int, dict[str, torch.Tensor]] = {}  # --hold-back: weights of each recent version
        held: dict[int, tuple] = {}  # --hold-back: step -> (rollout future, server version when it was sent)

        def hold_back(step: int) -> None:
            future = ahead.submit(rollout, client, pool, prompts_for(step), args, None, step, step)
            held[step] = (future, version)

        if args.hold_back:
            for s in range(min(2, args.steps)):
                hold_back(s)
        else:
            pending = ahead.submit(rollout, client, pool, prompts_for(0), args, version, 0)
        pending_version = version
        print(
            f"{'step':>4} {'reward':>7} {'mismatch_kl':>11} {'max|dlp|':>9} {'version':>7} {'stale':>5} "
            f"{'tok/s':>7} {'rollout_s':>9} {'train_s':>7} {'push_s':>6}"
        )
        bar = tqdm(range(args.steps), desc="grpo", unit="step", dynamic_ncols=True, file=sys.stderr)
        for step in bar:
            t0 = time.perf_counter()
            held_requests = 0
            if args.hold_back:
                snapshots = {v: p for v, p in snapshots.items() if v >= version - 2}
                snapshots[version] = {k: v.detach().clone() for k, v in model.named_parameters()}
                pending, sent_at = held.pop(step)
                groups, rollout_s = pending.result()
                expected = max(sent_at, step - 1)  # the server held it until it served step - 1
                held_requests = len(groups) if step - 1 > sent_at else 0
                sampler_params = snapshots[groups[0][0].policy_version]
                if step + 2 < args.steps:
                    hold_back(step + 2)  # needs version step + 1: held until the push below
            else:
                groups, rollout_s = pending.result()
                expected = pending_version
                sampler_params = snapshot
            if args.async_steps and not args.hold_back and step + 1 < args.steps:
                # sample the next batch with the current weights while this one trains
                snapshot = {k: v.detach().clone() for k, v in model.named_parameters()}
                pending = ahead.submit(rollout, client, pool, prompts_for(step + 1), args, version, step + 1)
                pending_version = version
            samples = [s for g in groups for s in g]
            versions = {v for s in samples for v in s.token_policy_versions()}
            rewards = [[task.reward(s) for s in g] for g in groups]
            advantages = torch.tensor([a for r in rewards for a in group_advantages(r)], dtype=torch.float32)
            batch = build_training_batch(samples, pad_id=tokenizer.pad_token_id or 0)

            t1 = time.perf_counter()
            stats = train_step(model, optimizer, batch, advantages, args, sampler_params, samples)
            train_s = time.perf_counter() - t1
            if args.hold_back and step + 1 in held:
                held[step + 1][0].result()  # running on the current weights: they finish before the push
            elif args.async_steps and step + 1 < args.steps:
                pending.result()  # the overlapped rollouts finish on the old weights before the push
            t2 = time.perf_counter()
            version = pusher.push(model, step + 1)
            push_s = time.perf_counter() - t2
            if not args.async_steps and step + 1 < args.steps:
                pending = ahead.submit(rollout, client, pool, prompts_for(step + 1), args, version, step + 1)
                pending_version = version

            tokens = sum(len(s.completion_ids) for s in samples)
            staleness = [version - 1 - v for v in versions]
            per_sample = [version - 1 - min(s.token_policy_versions(), default=version - 1) for s in samples]
            m = StepMetrics(
                step=step,
                reward_mean=statistics.fmean(r for g in rewards for r in g),
                mismatch_kl=stats["mismatch_kl"],
                max_abs_logprob_diff=stats["max_abs_logprob_diff"],
                policy_version=min(versions) if len(versions) == 1 else -1,
                expected_policy_version=expected,
                staleness_mean=statistics.fmean(staleness),
                staleness_max=max(staleness),
                loss=stats["loss"],
                clip_fraction=stats["clip_fraction"],
                completion_tokens=tokens,
                rollout_s=rollout_s,
                rollout_tokens_per_s=tokens / rollout_s,
                train_s=train_s,
                push_s=push_s,
                step_s=time.perf_counter() - t0,
                held_requests=held_requests,
                staleness_histogram=[per_sample.count(k) for k in range(max(per_sample) + 1)],
            )
            history.append(m)
            bar.set_postfix(reward=f"{m.reward_mean:.3f}", kl=f"{m.mismatch_kl:.1e}")
            tqdm.write(
                f"{m.step:>4} {m.reward_mean:>7.3f} {kl_text(m.mismatch_kl, args.exact):>11} {m.max_abs_logprob_diff:>9.2e} "
                f"{m.policy_version:>7} {m.staleness_max:>5} {m.rollout_tokens_per_s:>7.0f} "
                f"{m.rollout_s:>9.2f} {m.train_s:>7.2f} {m.push_s:>6.2f}",
                file=sys.stdout,
            )
            if out:
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(asdict(m)) + "\n")
    finally:
        # rollouts still in flight finish first: they need the client's loop and the server
        ahead.shutdown(cancel_futures=True)
        pool.shutdown(cancel_futures=True)
        if pusher is not None:
            pusher.close()
        client.close()
        if proc is not None:
            stop_server(proc)
            log.unlink(missing_ok=True)
        for d in sorted(weight_root.glob("**/*"), reverse=True):
            d.unlink() if d.is_file() else d.rmdir()
        weight_root.rmdir()
    if out and history:
        plot(history, out / "plot.png")
    return history


def kl_text(kl: float, exact: bool) -> str:
    """--exact prints the KL as the float it is (0.0), not rounded to a format."""
    return repr(kl) if exact else f"{kl:.2e}"


def plot_exact_vs_default(runs: dict[str, list[StepMetrics]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), constrained_layout=True)
    for label, history in runs.items():
        steps = [m.step for m in history]
        top.plot(steps, [m.reward_mean for m in history], marker="o", ms=3, label=label)
        bottom.semilogy(steps, [max(m.mismatch_kl, 1e-20) for m in history], marker="o", ms=3, label=label)
    top.set_ylabel("mean reward")
    top.set_title("GRPO through rlserve: --exact (true on-policy) against the default")
    bottom.set_ylabel("sampler-trainer KL\n(0.0 drawn at 1e-20)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "grpo.py: --out draws plot.png with matplotlib, which is not installed: "
            "pip install -e .[examples] (or pip install matplotlib), or drop --out"
        ) from None


def plot(history: list[StepMetrics], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m.step for m in history]
    fig, (top, bottom, stale) = plt.subplots(3, 1, figsize=(7, 7.5), constrained_layout=True)
    top.plot(steps, [m.reward_mean for m in history], marker="o", ms=3)
    top.set_ylabel("mean reward")
    top.set_ylim(0, 1)
    top.grid(alpha=0.3)
    top.set_title("GRPO through rlserve: reward, and the trainer/server logprob mismatch")
    bottom.semilogy(steps, [max(m.mismatch_kl, 1e-12) for m in history], marker="o", ms=3, label="mismatch KL")
    bottom.semilogy(
        steps, [max(m.max_abs_logprob_diff, 1e-12) for m in history], marker="s", ms=3, label="max |Δ logprob|"
    )
    bottom.set_ylabel("trainer vs rlserve\n(≤ 0 drawn at 1e-12)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    bottom.legend()
    counts = [sum(m.staleness_histogram[k] for m in history if k < len(m.staleness_histogram)) for k in range(3)]
    stale.bar(range(len(counts)), counts)
    stale.set_xticks(range(len(counts)))
    stale.set_xlabel("staleness of a sample (trainer version − sampling version)")
    stale.set_ylabel("samples")
    held = sum(m.held_requests for m in history)
    stale.set_title(f"staleness histogram ({held} requests held by the server until their version)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range of the importance ratio")
    p.add_argument(
        "--async-steps",
        type=int,
        choices=(0, 1),
        default=0,
        help="1: sample the next batch while this one trains (one step off-policy)",
    )
    p.add_argument(
        "--hold-back",
        action="store_true",
        help="one step off-policy with the server's admission control: rollouts queued two steps ahead "
        "(implies --async-steps 1; a --base-url server needs server.max_off_policy_steps 1 and a policy_wait_s)",
    )
    p.add_argument("--update-from-disk", action="store_true", help="push weights as safetensors files")
    p.add_argument(
        "--weights-dir",
        help="where --update-from-disk writes them (default: a temporary folder; "
        "with --base-url, one under that server's weight_roots)",
    )
    p.add_argument("--model", help="a Hugging Face model directory (default: rlserve's embedded model)")
    p.add_argument("--base-url", help="use this running rlserve (serving --model) instead of starting one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write DIR/metrics.jsonl and DIR/plot.png")
    p.add_argument(
        "--exact",
        action="store_true",
        help="true on-policy: the server in batch-invariant mode, the trainer patched by rlserve.train "
        "(the mismatch KL is exactly 0.0)",
    )
    p.add_argument("--compare-exact", action="store_true", help="run with --exact off, then on; plot both (--out)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="trainer and server dtype")
    args = p.parse_args(argv)
    args.async_steps = 1 if args.hold_back else args.async_steps
    if (args.exact or args.compare_exact) and (args.async_steps or args.base_url):
        p.error("--exact trains on-policy on a server it starts: drop --async-steps/--hold-back/--base-url")
    if args.compare_exact and not args.out:
        p.error("--compare-exact writes DIR/exact-vs-default.png: give --out DIR")
    return args


def compare_exact(args) -> dict[str, list[StepMetrics]]:
    """The same run with --exact off and on (same seeds); their rewards and KLs in one plot."""
    runs = {}
    for exact in (False, True):
        run_args = argparse.Namespace(**{**vars(args), "exact": exact, "out": str(Path(args.out) / f"exact-{exact}")})
        runs["--exact" if exact else "default"] = train(run_args)
    plot_exact_vs_default(runs, Path(args.out) / "exact-vs-default.png")
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the server this script started is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # leave the server a core
    started = time.perf_counter()
    if args.compare_exact:
        runs = compare_exact(args)
        for label, history in runs.items():
            print(f"{label}: reward per step {[round(m.reward_mean, 3) for m in history]}")
            print(f"{label}: KL per step {[m.mismatch_kl for m in history]}")
        print(f"wrote {args.out}/exact-vs-default.png")
        return 0
    history = train(args)
    wall = time.perf_counter() - started
    first = statistics.fmean(m.reward_mean for m in history[:3])
    last = statistics.fmean(m.reward_mean for m in history[-3:])
    print(
        f"{len(history)} steps in {wall:.0f} s: reward {first:.3f} -> {last:.3f} (mean of the first/last 3), "
        f"max mismatch KL {max(m.mismatch_kl for m in history):.1e}, "
        f"max |Δ logprob| {max(m.max_abs_logprob_diff for m in history):.1e}, "
        f"rollout {statistics.fmean(m.rollout_tokens_per_s for m in history):.0f} tok/s, "
        f"push {statistics.fmean(m.push_s for m in history):.2f} s/step"
    )
    if args.out:
        print(f"wrote {args.out}/metrics.jsonl and {args.out}/plot.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
