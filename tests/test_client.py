"""rlserve.client against real servers on 127.0.0.1: affinity, failover, retries through a real
HTTP hop, the weight-sync freeze, typed errors, sync and async APIs, training batches, the example."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from conftest import start_server, stop_server
from rlserve.client import (
    AdminError,
    BadRequest,
    ContextLengthExceeded,
    InferenceClient,
    RetryableError,
    ServerError,
    StreamInterrupted,
    SyncInferenceClient,
    WeightSyncTimeout,
    build_training_batch,
    hf_tokenizer,
    to_nexrl,
)
from rlserve.client.endpoints import rendezvous_score
from rlserve.model.make import make_model

ADMIN = "admin-key"
REPO = Path(__file__).resolve().parents[1]
LONG = [5] * 600  # over the 512-token context of the test servers


class Cluster:
    """Two real servers shared by the module. The failover test kills one; asking for urls() again restarts it."""

    def __init__(self, *args: str):
        self.args, self.procs = args, [None, None]
        self._urls: list[str] = ["", ""]

    def urls(self) -> list[str]:
        dead = [i for i, p in enumerate(self.procs) if p is None or p.poll() is not None]
        with ThreadPoolExecutor(2) as pool:
            for i, (url, proc) in zip(dead, pool.map(lambda _: start_server(*self.args), dead), strict=True):
                self._urls[i], self.procs[i] = url, proc
        return list(self._urls)

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait()

    def stop(self) -> None:
        for p in self.procs:
            if p is not None:
                stop_server(p)


@pytest.fixture(scope="module")
def cluster(root):
    c = Cluster("--weight_roots", json.dumps([str(root)]), "--server.admin_api_key", ADMIN)
    c.urls()
    try:
        yield c
    finally:
        c.stop()


class Proxy:
    """A real HTTP hop on 127.0.0.1: answers 503 to the first `fail` generate calls, forwards every
    other request to `target`, counts generate calls, and can go away and come back on its port."""

    GENERATE = "/inference/v1/generate"

    def __init__(self, target: str):
        self.target, self.fail, self.generate_calls, self.port = target, 0, 0, 0
        self._lock, self._http = threading.Lock(), httpx.Client(timeout=60)
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                proxy._handle(self)

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("content-length") or 0))
        if h.path.startswith(self.GENERATE):
            with self._lock:
                self.generate_calls += 1
                failing = self.generate_calls <= self.fail
            if failing:
                return _reply(h, 503, b'{"error":{"message":"warming up","type":"ServiceUnavailableError","code":503}}')
        headers = {k: h.headers[k] for k in ("content-type", "authorization", "x-session-id") if h.headers.get(k)}
        r = self._http.request(h.command, self.target + h.path, content=body, headers=headers)
        _reply(h, r.status_code, r.content, r.headers.get("content-type", "application/json"))


def _reply(h: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str = "application/json") -> None:
    h.send_response(status)
    h.send_header("content-type", content_type)
    h.send_header("content-length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


@pytest.fixture
def proxy(cluster):
    p = Proxy(cluster.urls()[0])
    try:
        yield p
    finally:
        p.stop()


def run(coro):
    return asyncio.run(coro)


# ---- routing ---------------------------------------------------------------------------------------


def test_sessions_stick_to_one_endpoint_and_spread_over_both(cluster):
    urls = cluster.urls()

    async def scenario():
        async with InferenceClient(urls) as client:
            calls = [
                client.generate(token_ids=[7, 8, i % 5 + 1], max_tokens=2, session_id=f"traj-{i % 16}")
                for i in range(64)
            ]
            by_session = await asyncio.gather(*calls)
            unsessioned = await asyncio.gather(*(client.generate(token_ids=[3], max_tokens=2) for _ in range(16)))
            return by_session, unsessioned

    by_session, unsessioned = run(scenario())
    served: dict[str, set[str]] = {}
    for i, s in enumerate(by_session):
        served.setdefault(f"traj-{i % 16}", set()).add(s.endpoint)
    assert all(len(eps) == 1 for eps in served.values()), served
    assert {ep for eps in served.values() for ep in eps} == set(urls)
    assert {s.endpoint for s in unsessioned} == set(urls)  # least busy first: 16 at once land on both


def test_an_endpoint_that_goes_away_loses_its_sessions_and_gets_them_back(cluster, proxy):
    a, b = proxy.url, cluster.urls()[1]

    async def scenario():
        async with InferenceClient([a, b], probe_interval=0.2, backoff_base=0.01) as client:

            async def home(session):
                return (await client.generate(token_ids=[1, 2], max_tokens=1, session_id=session)).endpoint

            sessions = [f"s{i}" for i in range(16)]
            before = {s: await home(s) for s in sessions}
            on_proxy = [s for s in sessions if before[s] == a]
            assert on_proxy and len(on_proxy) < len(sessions)
            proxy.stop()
            during = {s: await home(s) for s in sessions}
            down = await client.health()
            proxy.start()
            deadline = time.monotonic() + 120  # a hang guard: the probe runs every 0.2 s
            while await home(on_proxy[0]) != a:  # a background probe brings it back
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            after = {s: await home(s) for s in sessions}
            return before, during, down, after

    before, during, down, after = run(scenario())
    assert set(during.values()) == {b} and down == {a: False, b: True}
    assert after == before


# ---- retries and typed errors ------------------------------------------------------------------------


def test_real_503s_are_retried_with_backoff_until_the_deadline(proxy):
    proxy.fail = 3
    with SyncInferenceClient(proxy.url, backoff_base=0.01) as client:
        sample = client.generate(token_ids=[1, 2, 3], max_tokens=3)
        assert len(sample.completion_ids) == 3 and proxy.generate_calls == 4
        proxy.fail, proxy.generate_calls = 10**6, 0
    with SyncInferenceClient(proxy.url, backoff_base=0.01, backoff_max=0.05, retry_deadline=0.5) as client:
        started = time.monotonic()
        with pytest.raises(ServerError, match="warming up"):
            client.generate(token_ids=[1, 2, 3], max_tokens=3)
        assert time.monotonic() - started < 2 and proxy.generate_calls > 3


def test_4xx_are_never_retried_and_overflow_is_typed(proxy):
    with SyncInferenceClient(proxy.url, backoff_base=0.01) as client:
        with pytest.raises(BadRequest, match="out of vocabulary") as bad:
            client.generate(token_ids=[10**6], max_tokens=2)
        assert bad.value.status == 400 and not isinstance(bad.value, ContextLengthExceeded)
        with pytest.raises(ContextLengthExceeded, match="maximum context length is 512"):
            client.generate(token_ids=LONG, max_tokens=2)
        assert proxy.generate_calls == 2  # one request each
        empty = client.generate(token_ids=LONG, max_tokens=2, on_overflow="truncate_sample")
        assert (empty.completion_ids, empty.logprobs, empty.finish_reason) == ([], [], "length")
        assert proxy.generate_calls == 3
    with SyncInferenceClient(proxy.url, on_overflow="truncate_sample") as client:
        long_chat = [{"role": "user", "content": "word " * 600}]
        assert client.chat(long_chat, max_tokens=2).finish_reason == "length"
        with pytest.raises(ContextLengthExceeded):
            client.chat(long_chat, max_tokens=2, on_overflow="raise")


# ---- weight-sync freeze -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def next_weights(root):
    return make_model("tiny", root / "step-1", seed=1)


async def _server_state(urls):
    async with httpx.AsyncClient() as http:
        return [(await http.get(f"{u}/metrics", params={"format": "json"})).json() for u in urls]


def test_an_update_holds_new_generations_and_no_sample_mixes_versions(cluster, next_weights):
    urls = cluster.urls()

    async def scenario():
        async with InferenceClient(urls, admin_api_key=ADMIN) as client:
            old = {m["current_policy_version"] for m in (await client.metrics()).values()}
            assert len(old) == 1
            (old_version,) = old
            await client.generate(token_ids=[1], max_tokens=1)
            deadline = time.monotonic() + 300  # a hang guard only: a loaded machine may take long to admit them
            for _ in range(20):  # a try is void when one ends before all 8 were seen running (a fast machine)
                running = [
                    asyncio.create_task(
                        client.generate(
                            token_ids=[1, 2, k + 1],
                            max_tokens=300 + k,
                            temperature=0,
                            sampling_params={"ignore_eos": True},
                        )
                    )
                    for k in range(8)
                ]
                while sum(m["num_running"] for m in await _server_state(urls)) < 8 and not any(
                    t.done() for t in running
                ):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.005)
                if not any(t.done() for t in running):  # all of them on the servers, none finished
                    break
                await asyncio.gather(*running)
            else:
                pytest.fail("in 20 tries a generation of 300 tokens always finished before all 8 were running")
            update = asyncio.create_task(client.update_weights(str(next_weights)))
            await asyncio.sleep(0)
            held = [asyncio.create_task(client.generate(token_ids=[4, 5, k + 1], max_tokens=4)) for k in range(8)]

            async def watch(update):  # held by the client: the servers never see them during the update
                most_queued = 0
                while not update.done():
                    # a snapshot after a server resumed on the new weights may already hold a released
                    # request: only snapshots from inside the update (old weights, or still paused) count
                    during = [
                        m
                        for m in await _server_state(urls)
                        if m["current_policy_version"] == old_version or m["is_paused"]
                    ]
                    most_queued = max(most_queued, sum(m["queue_depth"] for m in during))
                    await asyncio.sleep(0.01)
                return await update, most_queued

            # the update waits for the 8 long generations to finish: a hang guard sized for a loaded machine
            versions, queued_on_servers = await asyncio.wait_for(watch(update), 600)
            return old.pop(), versions, await asyncio.gather(*running), await asyncio.gather(*held), queued_on_servers

    old, versions, running, held, queued_on_servers = run(scenario())
    assert versions == {u: old + 1 for u in urls}
    assert queued_on_servers == 0
    assert all(s.policy_version == old and len(s.completion_ids) == 300 + k for k, s in enumerate(running))
    assert all(s.policy_version == old + 1 for s in held)
    assert not any(s.mixed_versions for s in running + held)
    assert all(len(s.weight_versions) == 1 for s in running + held)


def test_a_pause_holds_generations_until_resume_or_weight_sync_timeout(cluster):
    url = cluster.urls()[0]
    admin = {"Authorization": f"Bearer {ADMIN}"}

    async def through_client():
        async with InferenceClient(url, admin_api_key=ADMIN, weight_sync_timeout=0.3) as client:
            await client.pause()
            with pytest.raises(WeightSyncTimeout, match="paused through this client"):
                await client.generate(token_ids=[1, 2], max_tokens=2)
            opted_in = asyncio.create_task(client.generate(token_ids=[1, 2], max_tokens=2, allow_mixed_versions=True))
            await asyncio.sleep(0.1)
            assert not opted_in.done()  # sent: the paused server queues it
            await client.resume()
            return await opted_in, await client.generate(token_ids=[1, 2], max_tokens=2)

    opted_in, after = run(through_client())
    assert len(opted_in.completion_ids) == 2 and len(after.completion_ids) == 2

    async def paused_by_someone_else():
        async with InferenceClient(url, probe_interval=0.05, weight_sync_timeout=0.3) as client:
            await client.generate(token_ids=[1], max_tokens=1)
            httpx.post(f"{url}/pause", params={"mode": "keep"}, headers=admin).raise_for_status()
            try:
                await asyncio.sleep(0.1)
                with pytest.raises(WeightSyncTimeout, match="is paused"):
                    await client.generate(token_ids=[1, 2], max_tokens=2)
            finally:
                httpx.post(f"{url}/resume", headers=admin).raise_for_status()
            await asyncio.sleep(0.1)
            return await client.generate(token_ids=[1, 2], max_tokens=2)

    assert len(run(paused_by_someone_else()).completion_ids) == 2


def test_admin_calls_reach_every_endpoint_and_report_failures(cluster, root):
    urls = cluster.urls()
    adapter = root / "adapter"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    torch.manual_seed(0)
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 128) * 0.1,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(128, 4) * 0.1,
        },
        str(adapter / "adapter_model.safetensors"),
    )
    with SyncInferenceClient(urls, admin_api_key=ADMIN) as client:
        before = {u: m["current_policy_version"] for u, m in client.metrics().items()}
        versions = client.load_adapter("policy", str(adapter))
        assert versions == {u: before[u] + 1 for u in urls}
        assert all(any(m["id"] == "policy" for m in httpx.get(f"{u}/v1/models").json()["data"]) for u in urls)
        sample = client.generate(token_ids=[1, 2, 3], max_tokens=3, sampling_params={}, session_id="x")
        assert sample.policy_version == before[sample.endpoint] + 1
        assert set(client.unload_adapter("policy")) == set(urls)
        with pytest.raises(AdminError, match="update_weights failed") as err:
            client.update_weights(str(root / "missing"))
        assert all(isinstance(err.value.results[u], BadRequest) and err.value.results[u].status == 404 for u in urls)
    with SyncInferenceClient(urls) as client, pytest.raises(AdminError, match="401"):
        client.pause()


# ---- both APIs, tokenizer agreement, training data ----------------------------------------------------


def test_sync_api_openai_surface_and_tokenizer_agree(cluster):
    urls = cluster.urls()
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    with SyncInferenceClient([u + "/v1" for u in urls]) as client:
        chat = client.chat(messages, tools=tools, max_tokens=4, session_id="t")
        assert chat.prompt_ids == client.apply_chat_template(messages, tools=tools)
        assert client.apply_chat_template(messages, enable_thinking=False) != client.apply_chat_template(messages)
        assert chat.message["role"] == "assistant" and len(chat.logprobs) == len(chat.completion_ids) == 4
        gen = client.generate("Hello there", max_tokens=4, temperature=0, session_id="g")
        assert gen.prompt_ids == client.tokenize("Hello there")
        assert gen.text == client.detokenize(gen.completion_ids)
        again = client.completions.create(
            prompt=gen.prompt_ids, max_tokens=4, temperature=0, return_token_ids=True, session_id="g"
        )
        assert again["choices"][0]["token_ids"] == gen.completion_ids  # same ids through either route
        raw = client.chat.completions.create(messages=messages, max_tokens=2, extra_body={"return_token_ids": True})
        assert raw["prompt_token_ids"] == client.apply_chat_template(messages)
        assert client.models()["data"][0]["max_model_len"] == 512
        assert client.health() == {u: True for u in urls}
        with ThreadPoolExecutor(8) as pool:  # threads share the client's loop
            many = list(pool.map(lambda i: client.generate(token_ids=[i + 1], max_tokens=2), range(16)))
        assert all(len(s.completion_ids) == 2 for s in many)


def test_streams_match_the_plain_answer_and_4xx_raise_before_any_chunk(cluster):
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    messages = [{"role": "user", "content": "hi"}]
    with SyncInferenceClient(cluster.urls()) as client:
        plain = client.completions.create(**body)["choices"][0]["text"]
        chunks = list(client.completions.create(**body, stream=True, session_id="s"))
        assert "".join(c["choices"][0]["text"] for c in chunks) == plain
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        chat = client.chat.completions.create(messages=messages, max_tokens=4, temperature=0)
        streamed = client.chat.completions.create(messages=messages, max_tokens=4, temperature=0, stream=True)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"])
        assert text == chat["choices"][0]["message"]["content"]
        with pytest.raises(BadRequest, match="temperature"):
            next(client.completions.create(**{**body, "temperature": -1}, stream=True))


@pytest.mark.parametrize("end", ["cut", "clean close without [DONE]"])
def test_a_stream_that_ends_early_raises_stream_interrupted(end):
    """A peer that sends one chunk and then breaks the body, as vllm-router does when its replica dies
    (tests/test_deploy_failover.py), or closes it cleanly without [DONE]."""
    listener = socket.create_server(("127.0.0.1", 0))
    chunk = b'data: {"choices":[{"index":0,"text":"hi"}]}\n\n'

    def serve():
        while True:
            conn, _ = listener.accept()
            with conn:
                if conn.recv(65536).startswith(b"GET"):  # the client's probes: up, not paused
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
                        b"connection: close\r\n\r\n{}"
                    )
                    continue
                head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                tail = b"" if end == "cut" else b"0\r\n\r\n"
                conn.sendall(head + b"%x\r\n" % len(chunk) + chunk + b"\r\n" + tail)
                return

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with listener, SyncInferenceClient(url, retry_deadline=10) as client:
        stream = client.completions.create(prompt="x", stream=True, allow_mixed_versions=True)
        assert next(stream)["choices"][0]["text"] == "hi"
        with pytest.raises(StreamInterrupted, match="send the request again") as cut:
            next(stream)
        assert isinstance(cut.value, RetryableError) and cut.value.received == 1


def test_generate_group_and_min_policy_version(cluster):
    url = cluster.urls()[0]
    with SyncInferenceClient([url]) as client:
        group = client.generate_group(token_ids=[1, 2, 3], n=4, max_tokens=3, seed=7, session_id="grp")
        assert len(group) == 4 and all(s.prompt_ids == [1, 2, 3] and len(s.logprobs) == 3 for s in group)
        assert len({tuple(s.completion_ids) for s in group}) > 1  # n samples, not one repeated
        current = group[0].policy_version
        assert client.generate(token_ids=[1, 2], max_tokens=2, min_policy_version=current).policy_version == current
        with pytest.raises(BadRequest, match="min_policy_version"):  # a 409: the server is behind the caller
            client.generate(token_ids=[1, 2], max_tokens=2, min_policy_version=current + 1)


def test_training_batch_shapes_masks_and_nexrl(cluster):
    urls = cluster.urls()

    async def scenario():
        async with InferenceClient(urls, on_overflow="truncate_sample") as client:
            return await asyncio.gather(
                client.generate(token_ids=[1, 2, 3], max_tokens=5),
                client.chat([{"role": "user", "content": "hi"}], max_tokens=3),
                client.generate(token_ids=LONG, max_tokens=5),
                client.models(),
            )

    *samples, models = run(scenario())
    batch = build_training_batch(samples)
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    assert batch.input_ids.shape == batch.loss_mask.shape == batch.logprobs.shape == (3, width)
    assert batch.loss_mask.sum(1).tolist() == [5.0, 3.0, 0.0]
    for b, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.completion_ids)
        assert batch.input_ids[b, :n].tolist() == s.prompt_ids + s.completion_ids
        assert batch.attention_mask[b].sum() == n and batch.loss_mask[b, :p].sum() == 0
        assert torch.allclose(batch.logprobs[b, p:n], torch.tensor(s.logprobs))
        assert batch.logprobs[b, :p].abs().sum() == 0
    assert batch.policy_versions.tolist() == [samples[0].policy_version, samples[1].policy_version, -1]
    assert batch.token_policy_versions[0, 3:8].tolist() == [samples[0].policy_version] * 5
    nexrl = to_nexrl(samples)
    assert nexrl["prompt_tokens"][0] == [1, 2, 3] and nexrl["response_tokens"][1] == samples[1].completion_ids
    assert [len(x) for x in nexrl["response_logprobs"]] == [5, 3, 0]
    tokenizer = hf_tokenizer(models["data"][0]["root"])
    assert tokenizer.pad_token is not None
    assert tokenizer.decode(samples[0].completion_ids) == samples[0].text


def test_rollouts_example_runs_against_a_server(cluster):
    url = cluster.urls()[0]
    example = REPO / "examples" / "rollouts.py"
    out = subprocess.run(
        [sys.executable, str(example), "--base-url", url, "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "4 prompts x 4 samples = 16 samples" in out.stdout and "advantages" in out.stdout


# ---- failover (last: it kills a server of the shared pair) -------------------------------------------


def test_failover_when_a_server_is_killed_mid_run_loses_no_sample(cluster):
    urls = cluster.urls()

    async def scenario():
        async with InferenceClient(urls, probe_interval=0.5, backoff_base=0.01) as client:
            done: list = []

            async def one(i):
                s = await client.generate(
                    token_ids=[11, 12, i + 1],
                    max_tokens=8 + 4 * i,
                    temperature=0,
                    session_id=f"traj-{i}",
                    sampling_params={"ignore_eos": True},
                )
                done.append(s)
                return s

            tasks = [asyncio.create_task(one(i)) for i in range(40)]
            deadline = time.monotonic() + 300  # a hang guard
            while len(done) < 4:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            cluster.kill(1)
            return await asyncio.gather(*tasks)

    samples = run(scenario())
    assert [len(s.completion_ids) for s in samples] == [8 + 4 * i for i in range(40)]
    assert all(len(s.logprobs) == len(s.completion_ids) and s.finish_reason == "length" for s in samples)
    homes = [max(urls, key=lambda u: rendezvous_score(f"traj-{i}", u)) for i in range(40)]
    assert all(s.endpoint == urls[0] for s, home in zip(samples, homes, strict=True) if home == urls[0])
    failed_over = [s for s, home in zip(samples, homes, strict=True) if home == urls[1] and s.endpoint == urls[0]]
    assert failed_over  # sessions of the killed server finished on the other one
