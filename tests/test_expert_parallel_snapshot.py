"""A deployment's copy of the served weights (/deployment/save_weights) from a server whose experts are spread over
two data-parallel engines (enable_expert_parallel, enable_eplb with replicated experts, rebalanced while
serving): each engine writes its part of a sharded checkpoint, every expert exactly once, and the index names
them. The copy holds the served tensors bit for bit, and a one-rank server that loads it answers as the
expert-parallel server did; the expert-parallel server replays it too. The loader reads such parts through
their index; an index over parts that leave an expert out or write one twice is refused. Two servers forming
one expert group (Wide-EP) each write their engine's part into one directory (`parts_only`), numbered by the
engine's rank in the group, and one indexes both (`index_parts`); a server that cannot see that directory, or
an index missing a server's part, is refused with a 409 that names deployment.snapshot_dir."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from conftest import start_server, stop_server
from rlserve.model.loader import load_model
from rlserve.model.make import make_model
from rlserve.model.shape import ModelShape
from rlserve.runtime.ports import free_port
from rlserve.runtime.weight_snapshot import INDEX_FILE, write_index
from test_server_expert_parallel import metric
from test_server_rl import PROMPTS, choice_lps

KEY = {"x-rlserve-deployment-key": "ep-snapshot-key"}
PARTS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def answers(url: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for prompt in PROMPTS:
        body = {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 0}}
        r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append((choice["token_ids"], choice_lps(choice)))
    return out


def update(url: str, weight_dir, headers: dict | None = None) -> None:
    r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(weight_dir)}, headers=headers, timeout=300)
    assert r.status_code == 200, r.text


def test_each_engine_writes_its_experts_once_and_the_copy_serves_as_the_ep_server(root, monkeypatch):
    base = make_model("tiny-moe", root / "base", seed=0)
    step_1 = make_model("tiny-moe", root / "step-1", seed=1)
    monkeypatch.setenv("RLSERVE_DEPLOYMENT_KEY", KEY["x-rlserve-deployment-key"])  # the route is a replica's
    url, proc = start_server(
        "--model.name", str(base), "--weight_roots", json.dumps([str(root)]),
        "--parallel.dp", "2", "--parallel.enable_expert_parallel", "true", "--parallel.enable_eplb", "true",
        "--parallel.eplb_step_interval", "4", "--parallel.eplb_num_redundant_experts", "2",
    )  # fmt: skip
    try:
        update(url, step_1, KEY)
        answers(url)  # load to rebalance on: the placement moves and replicates experts
        assert metric(url, "rlserve:eplb_rebalances_total")[""] >= 1
        served = answers(url)
        r = httpx.post(f"{url}/deployment/save_weights", json={"weight_dir": str(root / "copy")}, headers=KEY)
        assert r.status_code == 200, r.text
        copy = root / "copy"
        assert r.json()["weight_dir"] == str(copy) and r.json()["policy_version"] == 1
        assert sorted(os.listdir(copy)) == [*PARTS, INDEX_FILE] and not list(root.glob(".*partial"))
        parts = [load_file(copy / part) for part in PARTS]
        want = load_file(step_1 / "model.safetensors")
        assert not set(parts[0]) & set(parts[1]) and set(parts[0]) | set(parts[1]) == set(want)  # each once
        assert all(".mlp.experts." in name for name in parts[1])  # engine 1: its experts only
        assert {name.split(".mlp.experts.")[0] for name in parts[1]} == {f"model.layers.{i}" for i in (0, 1, 3)}
        weight_map = json.loads((copy / INDEX_FILE).read_text())["weight_map"]
        assert weight_map == {name: PARTS[i] for i, part in enumerate(parts) for name in part}
        for name, tensor in want.items():
            got = (parts[0] | parts[1])[name]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        update(url, copy, KEY)  # what a restarted replica replays
        assert answers(url) == served
    finally:
        stop_server(proc)
    monkeypatch.delenv("RLSERVE_DEPLOYMENT_KEY")
    url, proc = start_server("--model.name", str(base), "--weight_roots", json.dumps([str(root)]))  # one rank
    try:
        assert [ids for ids, _ in answers(url)] != [ids for ids, _ in served]  # the base weights answer otherwise
        update(url, copy)
        # the same tokens; logprobs as one rank's are to expert parallelism's (its experts summed on other ranks)
        for (ids, lps), (want_ids, want_lps) in zip(answers(url), served):
            assert ids == want_ids
            assert torch.allclose(torch.tensor(lps), torch.tensor(want_lps), rtol=0, atol=1e-5)
    finally:
        stop_server(proc)


def test_an_index_over_parts_that_leave_out_or_repeat_an_expert_is_refused(tmp_path):
    model_dir = make_model("tiny-moe", tmp_path / "m", seed=3)
    shape = ModelShape.from_hf(AutoConfig.from_pretrained(model_dir))
    tensors = load_file(model_dir / "model.safetensors")
    expert = "model.layers.1.mlp.experts.5.down_proj.weight"
    first = {n: t for n, t in tensors.items() if ".experts.5." not in n}
    second = {n: t for n, t in tensors.items() if ".experts.5." in n}
    for name, parts, error in [
        ("whole", [first, second], None),
        ("left-out", [first, {n: t for n, t in second.items() if n != expert}], "no engine wrote"),
        ("twice", [first, second | {"model.norm.weight": tensors["model.norm.weight"]}], "written twice"),
    ]:
        out = tmp_path / name
        out.mkdir()
        for i, part in enumerate(parts):
            save_file(part, out / PARTS[i])
        if error is None:
            write_index(str(out), PARTS, shape)
            assert set(json.loads((out / INDEX_FILE).read_text())["weight_map"]) == set(tensors)
            loaded = load_model(out, shape, torch.float32, torch.device("cpu")).state_dict()  # what a start reads
            for key, value in load_model(model_dir, shape, torch.float32, torch.device("cpu")).state_dict().items():
                assert torch.equal(loaded[key], value), key
        else:
            with pytest.raises(RuntimeError, match=error):
                write_index(str(out), PARTS, shape)


def test_wide_ep_servers_write_their_parts_into_one_directory_and_one_indexes_them(root, monkeypatch):
    base = make_model("tiny-moe", root / "wide-base", seed=0)
    step_1 = make_model("tiny-moe", root / "wide-step-1", seed=1)
    monkeypatch.setenv("RLSERVE_DEPLOYMENT_KEY", KEY["x-rlserve-deployment-key"])
    group = ("--model.name", str(base), "--weight_roots", json.dumps([str(root)]), "--parallel.enable_expert_parallel",
             "true", "--parallel.data_parallel_size", "2", "--parallel.data_parallel_address", "127.0.0.1",
             "--parallel.data_parallel_rpc_port", str(free_port()))  # fmt: skip
    with ThreadPoolExecutor(2) as pool:  # each waits in the group's rendezvous for the other
        lines = [(*group, "--parallel.data_parallel_start_rank", str(rank)) for rank in (0, 1)]
        started = list(pool.map(lambda line: start_server(*line), lines))
    urls = [url for url, _ in started]

    def save(url: str, body: dict) -> httpx.Response:
        return httpx.post(f"{url}/deployment/save_weights", json=body, headers=KEY, timeout=300)

    try:
        for url in urls:
            update(url, step_1, KEY)
        served = answers(urls[0])
        copy = root / "wide-copy"
        r = save(urls[0], {"weight_dir": str(copy)})  # no one server holds every expert
        assert r.status_code == 409 and "parts_only" in r.text, r.text
        r = save(urls[1], {"weight_dir": str(copy), "parts_only": True})  # the supervisor did not make it here
        assert r.status_code == 409 and "deployment.snapshot_dir" in r.text, r.text
        partial = root / ".wide-copy.partial"
        partial.mkdir()
        with ThreadPoolExecutor(2) as pool:
            body = {"weight_dir": str(copy), "parts_only": True}
            replies = [r.json() for r in pool.map(lambda url: save(url, body), urls)]
        assert [r["files"] for r in replies] == [[PARTS[0]], [PARTS[1]]]  # numbered by rank in the whole group
        assert len({(r["policy_version"], r["weight_version"], r["placement_key"]) for r in replies}) == 1
        assert replies[0]["policy_version"] == 1
        r = save(urls[1], {"weight_dir": str(copy), "index_parts": ["../model.safetensors"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "index_parts", r.text
        os.rename(partial / PARTS[1], root / "elsewhere.safetensors")  # as if node 1 wrote to its own disk
        r = save(urls[1], {"weight_dir": str(copy), "index_parts": PARTS})
        assert r.status_code == 409 and "deployment.snapshot_dir" in r.text, r.text
        os.rename(root / "elsewhere.safetensors", partial / PARTS[1])
        r = save(urls[1], {"weight_dir": str(copy), "index_parts": PARTS})
        assert r.status_code == 200 and r.json() == {"weight_dir": str(copy)}, r.text
        assert sorted(os.listdir(copy)) == [*PARTS, INDEX_FILE] and not partial.exists()
        want = load_file(step_1 / "model.safetensors")
        got = load_file(copy / PARTS[0]) | load_file(copy / PARTS[1])
        assert set(got) == set(want) and all(torch.equal(got[name], t) for name, t in want.items())
        for url in urls:  # what a restarted server replays
            update(url, copy, KEY)
        assert answers(urls[0]) == served and answers(urls[1]) == served
    finally:
        for _, proc in started:
            stop_server(proc)
    monkeypatch.delenv("RLSERVE_DEPLOYMENT_KEY")


def test_parts_are_written_again_until_every_writer_copied_the_same_weights():
    """until_agreed, which both the engines of one server and the servers of a Wide-EP group write through: a
    round whose writers copied different versions (an update landed between their copies) is discarded and
    written again; a writer's failure ends it, and so does a fourth disagreement."""
    import asyncio

    from rlserve.server.fleet.save_weights import until_agreed

    rounds = iter([[1, 2], [3, 3]])
    discarded: list = []

    async def write():
        return next(rounds)

    assert asyncio.run(until_agreed(write, lambda r: r, discarded.append, "x")) == [3, 3]
    assert discarded == [[1, 2]]

    async def failing():
        return [1, ValueError("disk full")]

    with pytest.raises(ValueError, match="disk full"):
        asyncio.run(until_agreed(failing, lambda r: r, discarded.append, "x"))

    async def never():
        return [1, 2]

    with pytest.raises(RuntimeError, match="the weights changed while they copied, 3 times"):
        asyncio.run(until_agreed(never, lambda r: r, lambda r: None, "the weights"))
