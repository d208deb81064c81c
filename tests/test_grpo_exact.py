"""examples/grpo.py --exact: the sampler (rlserve, batch-invariant) and the trainer (patched by rlserve.train)
share numerics, so the mismatch KL is exactly 0.0 at every step; --compare-exact plots reward against step
with --exact off and on."""

from __future__ import annotations

import json

from test_grpo import load_grpo_example


def test_grpo_exact_prints_kl_exactly_zero_and_plots_both_runs(tmp_path, capsys):
    grpo = load_grpo_example()
    args = grpo.parse_args(
        ["--compare-exact", "--dtype", "bfloat16", "--steps", "3", "--lr", "3e-4"]
        + ["--prompts-per-step", "2", "--group-size", "4", "--out", str(tmp_path)]
    )
    runs = grpo.compare_exact(args)
    exact, default = runs["--exact"], runs["default"]
    assert len(exact) == len(default) == 3
    assert [m.mismatch_kl for m in exact] == [0.0, 0.0, 0.0]  # exactly, not within a tolerance
    assert [m.max_abs_logprob_diff for m in exact] == [0.0, 0.0, 0.0]
    assert all(m.mismatch_kl > 0 for m in default)  # bf16 without --exact: the mismatch the issue measured
    assert [m.policy_version for m in exact] == [0, 1, 2]
    printed = [line.split() for line in capsys.readouterr().out.splitlines()]
    kl_column = [row[2] for row in printed if len(row) > 3 and row[0].isdigit()]
    assert kl_column[3:] == ["0.0", "0.0", "0.0"]  # the --exact run's lines, after the default run's
    rows = [json.loads(line) for line in (tmp_path / "exact-True" / "metrics.jsonl").read_text().splitlines()]
    assert [r["mismatch_kl"] for r in rows] == [0.0, 0.0, 0.0]
    for png in (tmp_path / "exact-vs-default.png", tmp_path / "exact-True" / "plot.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
