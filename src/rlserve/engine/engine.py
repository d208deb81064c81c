"""The synchronous engine: add requests, call `step()` (schedule -> run -> sample -> postprocess)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from rlserve.config.schema import Config
from rlserve.engine.allocator import keep_freed_memory
from rlserve.engine.detectors import Detectors
from rlserve.engine.detokenizer import IncrementalDetokenizer
from rlserve.engine.devices import resolve_device, resolve_dtype, resolve_head_dtype
from rlserve.engine.inflight import InflightPolicy, mark_kv_version
from rlserve.engine.inflight import apply as apply_inflight_policy
from rlserve.engine.invariant import InvariantSampler, check_supported
from rlserve.engine.kv.mooncake import KVMooncake
from rlserve.engine.kv.offload import KVOffload
from rlserve.engine.kv.pool import BlockPool, extra_key
from rlserve.engine.kv.transfer import KVTransfer
from rlserve.engine.memory import kv_budget, memory_at_start, num_kv_blocks
from rlserve.engine.outputs import RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.engine.prompt_logprobs import record_prompt_logprobs
from rlserve.engine.routing import RoutedExpertsPool, offload_routed_experts
from rlserve.engine.runner import ModelRunner, kv_bytes_per_token
from rlserve.engine.sampler import Sampler, sampling_row
from rlserve.engine.scheduler import Scheduler
from rlserve.engine.sequence import Request, Sequence, Status
from rlserve.engine.stats import EngineStats, engine_stats
from rlserve.engine.stopping import finish_reason, prompt_ids
from rlserve.engine.structured import DEAD_END, StructuredOutputs
from rlserve.engine.tp.comm import attach, device_of_rank, expert_parallel
from rlserve.engine.tp.kv_transfer import RankSlices, uses_kv_group
from rlserve.engine.tp.leader import TensorParallelLeader
from rlserve.engine.weights import StagedWeights, commit
from rlserve.model.loader import eos_token_ids, load_model, resolve_model_dir
from rlserve.model.lora import LoraAdapter
from rlserve.model.shape import ModelShape
from rlserve.model.tensor_parallel import check_tp

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: Config | None = None):
        config = config or Config()
        if config.parallel.tp > 1 and not config.num_threads:  # the ranks split the cores (workers read this config)
            config = config.model_copy(update={"num_threads": max(1, (os.cpu_count() or 1) // config.parallel.tp)})
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.model_dir: Path = resolve_model_dir(config.model.name)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir, trust_remote_code=config.model.trust_remote_code)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=config.model.trust_remote_code)
        self.shape = ModelShape.from_hf(self.hf_config)
        self.max_model_len = config.model.max_model_len or self.shape.max_position_embeddings
        if self.max_model_len > self.shape.max_position_embeddings:  # the rope table ends there (as vLLM refuses)
            raise ValueError(
                f"model.max_model_len={self.max_model_len} is longer than this model's context: its "
                f"config.json has max_position_embeddings={self.shape.max_position_embeddings}; set "
                f"model.max_model_len to {self.shape.max_position_embeddings} or less"
            )
        tp = config.parallel.tp
        check_tp(self.shape, tp, experts_whole=config.parallel.enable_expert_parallel)
        if tp > 1 and self.device.type == "cuda":
            self.device = device_of_rank(self.device, 0)
        self.vocab_size = self.shape.vocab_size
        self.eos_token_ids = eos_token_ids(self.model_dir, self.hf_config, self.tokenizer)
        memory = memory_at_start(self.device) if config.gpu_memory_utilization else 0
        self.model = load_model(self.model_dir, self.shape, self.dtype, self.device, 0, tp, expert_parallel(config, 0))
        self.model.set_head_dtype(resolve_head_dtype(config.model.lm_head_dtype, self.dtype))

        ec = config.engine
        budget = ec.kv_cache_bytes or config.memory_budget_bytes
        if tp > 1 and self.device.type == "cpu":
            # the ranks share the host's memory: each takes 1/tp of it (its KV heads of every block)
            budget, memory = (budget and budget // tp), memory // tp
        per_token = kv_bytes_per_token(self.model, self.dtype)
        if not budget and config.gpu_memory_utilization:
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            useful = ec.max_num_seqs * self.max_model_len * per_token
            budget = kv_budget(config.gpu_memory_utilization, memory, weights, useful)
        num_blocks = num_kv_blocks(budget or None, per_token, ec.block_size, ec.max_num_seqs, self.max_model_len)
        if num_blocks * ec.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * ec.block_size} tokens, fewer than max_model_len "
                f"({self.max_model_len}): raise engine.kv_cache_bytes or lower model.max_model_len"
            )
        if ec.batch_invariant:
            check_supported(config, self.device, self.dtype)
        self.pool = BlockPool(num_blocks, ec.block_size, ec.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, ec.max_num_seqs, ec.max_num_batched_tokens, self._cache_key)
        self.scheduler.batch_window_s = ec.batch_window_ms / 1000
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            ec.block_size,
            self.dtype,
            self.device,
            cascade_attention=ec.cascade_attention,
            pack_weights=ec.pack_weights,
            use_cpu_kernels=ec.cpu_kernels,
            batch_invariant=ec.batch_invariant,
        )
        if config.enable_return_routed_experts:
            if self.shape.moe is None:
                raise ValueError(
                    "enable_return_routed_experts needs a mixture-of-experts model (Qwen3-MoE); this one is dense"
                )
            self.runner.routing = RoutedExpertsPool(self.shape.moe, num_blocks, ec.block_size)
        self.tp: TensorParallelLeader | None = None
        if tp > 1:  # every rank's pool has the same blocks, so block tables (and the prefix cache) are rank 0's alone
            self.tp = self.runner.tp = TensorParallelLeader(config, self.shape, num_blocks, self.device)
            self.tp.attach(self.model)
        elif expert_parallel(config, 0) is not None:  # one rank of expert parallelism over dp engines
            attach(self.model, None, 0, config)
        # no decode graphs under tp (they do not capture the step broadcast), MoE (expert blocks size on the host)
        # or batch invariance (they capture the default kernels)
        eager = config.model.enforce_eager or ec.batch_invariant
        if self.device.type == "cuda" and not eager and self.shape.moe is None and tp == 1:
            self.runner.use_decode_graphs(ec.max_num_seqs, self.max_model_len)
        # the store and the P/D wire hold whole blocks: rank 0 gathers and scatters its workers' head slices
        slices = RankSlices(self.tp, self.runner.kv_cache, ec.block_size) if self.tp and uses_kv_group(config) else None
        self.offload: KVOffload | KVMooncake | None = None
        if config.kv_cache_offload is not None:
            if config.kv_cache_offload.type == "mooncake":  # one store shared by every replica
                self.offload = KVMooncake(
                    config.kv_cache_offload,
                    self.runner.kv_cache,
                    ec.block_size,
                    str(config.model.name),
                    lambda: self.weight_version,
                    ranks=slices,
                )
            else:
                self.offload = KVOffload(config.kv_cache_offload, self.runner.kv_cache, ec.block_size, self.tp)
            self.scheduler.offload = self.offload
            self.pool.on_evict = self.offload.save
            if self.runner.routing is not None:
                offload_routed_experts(self.offload, self.runner.routing)
        self.kv_transfer: KVTransfer | None = None
        if config.kv_transfer is not None:
            self.kv_transfer = KVTransfer(
                config.kv_transfer,
                self.pool,
                self.runner.kv_cache,
                self.scheduler,
                self._cache_key,
                lambda: self.weight_generation,
                self.runner.routing.block_metadata if self.runner.routing is not None else None,
                slices,
            )
        generator = torch.Generator().manual_seed(config.seed)
        self.sampler = (InvariantSampler if ec.batch_invariant else Sampler)(generator, self.runner.kernels)
        self.detectors = Detectors(config.logits_processors, self.vocab_size)
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        eos = getattr(self.hf_config, "eos_token_id", None)
        self.detector_eos = (
            (eos[0] if isinstance(eos, list) else eos) if eos is not None else self.tokenizer.eos_token_id
        )
        self.policy_version = 0
        self.weight_version = config.weight_version  # the trainer's label for the current weights
        self.weight_generation = 0  # bumps at every committed update: prefix-cache entries never cross it
        self.adapters: dict[str, LoraAdapter] = {}
        self.adapter_generations: dict[str, int] = {}  # bumps at every (re)load of a name
        self.requests: dict[str, list[Request]] = {}
        self.generation_tokens = 0
        self._pending: list[Request] = []  # finished outside a step (aborts), reported by the next one
        self._ids = itertools.count()

    # ---- public API -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        adapter: str | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the field at fault."""
        self.submit(self.make_request(request_id, prompt, params, cache_salt=cache_salt, adapter=adapter))

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        adapter: str | None = None,
    ) -> Request:
        """Everything that can fail for the caller, without touching engine state (any thread)."""
        params = params or SamplingParams()
        params.validate()
        ids = prompt_ids(prompt, self.tokenizer, self.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; this model's maximum context length is {self.max_model_len} "
                f"tokens and at least one must be left to generate: shorten the prompt"
            )
        for name in ("stop_token_ids", "forced_token_ids", "logit_bias"):
            bad = [t for t in getattr(params, name) or [] if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} {bad} are outside the vocabulary [0, {self.vocab_size})")
        cap = self.config.engine.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and cap != -1 and (k > cap or (k == -1 and self.vocab_size > cap)):
                raise ValueError(f"{name}={k} exceeds the server's max_logprobs ({cap})")
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"adapter {adapter!r} is not loaded")
        grammar = self.structured.check(params.structured_outputs, params.allowed_token_ids)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(request_id, ids, params, max_tokens, cache_salt=cache_salt, adapter=adapter)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
            req.prompt_logprob_ranks = [None] * len(ids)
        for j in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed((params.seed + j * 0x9E3779B1) % (1 << 63))
            detok = IncrementalDetokenizer.create(self.tokenizer, ids, params) if params.detokenize else None
            req.seqs.append(Sequence(req, j, generator, detok))
            req.seqs[-1].grammar = grammar
        return req

    def submit(self, req: Request) -> None:
        self.requests.setdefault(req.request_id, []).append(req)
        if self.kv_transfer is not None and self.kv_transfer.start_pull(req):
            return  # scheduled once its prompt's KV has arrived (poll_transfers)
        self.scheduler.add(req.seqs[0])

    def poll_transfers(self) -> None:
        """Between two steps: land pulled KV, free pins that were pulled, aborted or timed out."""
        if self.kv_transfer is not None:
            self.kv_transfer.poll()

    @property
    def transfers_pending(self) -> bool:
        return self.kv_transfer is not None and self.kv_transfer.busy

    def abort(self, request_id: str) -> int:
        """Finish every request with this id now ("abort", partial tokens kept); returns how many."""
        reqs = list(self.requests.get(request_id, []))
        for req in reqs:
            self.abort_request(req)
        if self.kv_transfer is not None:  # a prefilled request's pin goes with its id (a repeat is harmless)
            self.kv_transfer.release_request(request_id)
        return len(reqs)

    def abort_request(self, req: Request) -> None:
        if req.finished:
            return
        for seq in req.live_seqs:
            if seq.status is not Status.FINISHED:
                seq.finish_reason = "abort"
                if seq.detok is not None:
                    seq.detok.flush()
                self._capture_routing(seq)
                self.scheduler.finish(seq)
        if self.kv_transfer is not None:
            self.kv_transfer.release_held(req)
        self._forget(req)
        self._pending.append(req)

    def abort_all(self) -> int:
        reqs = [r for rs in self.requests.values() for r in rs]
        for req in reqs:
            self.abort_request(req)
        return len(reqs)

    def take_pending(self) -> list[Request]:
        """Outputs produced outside a step (aborts), for a caller that is not stepping (paused)."""
        pending, self._pending = self._pending, []
        return pending

    def commit_weights(
        self, staged: StagedWeights, weight_version: str | None = None, inflight: str | None = None
    ) -> int:
        """Swap in validated weights between steps; every later token carries the new version.
        `inflight` (engine/inflight.py; default engine.inflight_update_policy): what the sequences
        in flight do."""
        policy = InflightPolicy.parse(inflight or self.config.engine.inflight_update_policy)
        commit(self.model, staged)
        version = self._bump_version(weight_version)
        apply_inflight_policy(self, policy)
        return version

    def add_adapter(self, adapter: LoraAdapter) -> int:
        """Load or reload (in place, same name) an adapter; requests already using the name go on
        with the new weights from the next step, like a weight update."""
        if self.config.engine.batch_invariant:
            raise ValueError(
                "LoRA adapters are not batch-invariant yet (their matmuls follow the step's rows); "
                "load adapters on a server without engine.batch_invariant"
            )
        self.adapters[adapter.name] = adapter
        self.adapter_generations[adapter.name] = self.adapter_generations.get(adapter.name, 0) + 1
        return self._bump_version(None)

    def remove_adapter(self, name: str) -> int:
        """Unload an adapter; requests still using it are aborted. Returns how many."""
        users = [r for rs in self.requests.values() for r in rs if r.adapter == name]
        for req in users:
            self.abort_request(req)
        del self.adapters[name]
        return len(users)

    def _bump_version(self, weight_version: str | None) -> int:
        self.policy_version += 1
        self.weight_generation += 1
        if self.offload is not None:  # nothing cached can match any more: free the tiers now
            self.pool.reset_prefix_cache()
            self.offload.clear(self.weight_generation)
        if weight_version is not None:
            self.weight_version = weight_version
        return self.policy_version

    def close(self) -> None:
        """Release what outlives the process otherwise (the disk tier's files, tensor-parallel workers)."""
        if self.offload is not None:
            self.offload.close()
        if self.tp is not None:
            self.tp.close()
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        self.structured.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the (cumulative) outputs of every request it touched."""
        return [out for _, out in self.step_with_requests()]

    def step_with_requests(self) -> list[tuple[Request, RequestOutput]]:
        return [(req, req.output()) for req in self.step_requests()]

    @torch.inference_mode()
    def step_requests(self) -> list[Request]:
        """One iteration; the requests it touched. Outputs are built by the caller, only for the
        requests it reports (a server need not copy every request's lists every step)."""
        self.poll_transfers()
        touched_list, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch.empty:
            return touched_list
        if self.offload is not None:
            self.offload.before_run()
        self.scheduler.stats.num_steps += 1
        batch_size = len(batch.decodes) + len(batch.prefills)
        for seq in itertools.chain(batch.decodes, (s for s, _ in batch.prefills)):
            seq.request.max_batch_size = max(seq.request.max_batch_size, batch_size)
        logits = self.runner.run(batch, self.adapters)
        mark_kv_version(batch, self.policy_version)
        touched: dict[int, Request] = {}
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            self.scheduler.stats.prompt_tokens_computed += n
            touched[id(seq.request)] = seq.request
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        # cache computed blocks before sampling: a sequence finishing now releases them right away
        for seq, _ in batch.prefills:
            self.scheduler.register_computed_blocks(seq)
        for seq in batch.decodes:
            self.scheduler.register_computed_blocks(seq)
        for seq, first, rows in logits.prompt_logits:
            record_prompt_logprobs(seq.request, first, rows, self.config.engine.batch_invariant)
        if logits.sample_seqs:
            self._sample_and_append(logits.sample_logits, logits.sample_seqs, touched)
        for req in touched.values():
            touched_list.append(req)
            if req.finished:
                self._forget(req)
        return touched_list

    def generate(
        self,
        prompts: str | list[int] | Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]

    @property
    def stats(self) -> EngineStats:
        return engine_stats(self)

    # ---- internals --------------------------------------------------------------------------

    def _sample_and_append(self, logits: torch.Tensor, seqs: list[Sequence], touched: dict) -> None:
        # a request whose prompt just finished samples all n first tokens from the same logits row
        rows_seqs: list[Sequence] = []
        row_index: list[int] = []
        forking: list[Request] = []
        for i, seq in enumerate(seqs):
            req = seq.request
            if seq.index == 0 and not req.forked and len(req.seqs) > 1:
                forking.append(req)
                rows_seqs.extend(req.seqs)
                row_index.extend([i] * len(req.seqs))
            else:
                rows_seqs.append(seq)
                row_index.append(i)
        if len(row_index) != len(seqs):
            logits = logits.index_select(0, torch.tensor(row_index, device=logits.device))
        masks = self.structured.masks(rows_seqs)
        for seq, mask in zip(rows_seqs, masks):
            if mask is not None and seq.detected is None and not bool(mask.any()):
                seq.detected = DEAD_END  # nothing may follow: EOS comes next, one-hot, as after a detection
        sampling_rows = [
            sampling_row(s, self.eos_token_ids, self.config.engine.logprobs_mode, self.detector_eos) for s in rows_seqs
        ]
        for row, mask in zip(sampling_rows, masks):
            row.allowed = mask if row.forced_id is None else None
        probe = self.detectors.probe(logits, sampling_rows) if self.detectors.active else None
        result = self.sampler(logits, sampling_rows)
        now = time.monotonic()
        for req in forking:  # before sample 0 can finish (its first token may stop it) and release the prompt
            for sibling in req.seqs[1:]:
                self.scheduler.fork(req.seqs[0], sibling)
        for r, seq in enumerate(rows_seqs):
            req = seq.request
            touched[id(req)] = req
            token = result.token_ids[r]
            seq.append_token(token, self.policy_version, self.weight_version)
            self.generation_tokens += 1
            if seq.logprobs is not None:
                seq.logprobs.append(result.logprobs[r])
            if seq.top_logprobs is not None:
                seq.top_logprobs.append(dict(result.top_logprobs[r]))
            req.first_token_time = req.first_token_time or now
            seq.last_token_time = now
            if seq.matcher is not None and seq.detected is None and not self.structured.advance(seq, token):
                seq.detected = DEAD_END
            self._check_finish(seq, token)  # before detecting: a detection ends the sequence one token later
            if probe is not None and seq.detected is None and seq.status is not Status.FINISHED:
                seq.detected = self.detectors.check(probe, r, seq, token)
        for req in forking:
            req.forked = True

    def _check_finish(self, seq: Sequence, token: int) -> None:
        reason, stop_reason = finish_reason(seq, token, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            if seq.detok is not None:
                seq.detok.flush()
            self._capture_routing(seq)
            kt = seq.params.kv_transfer_params
            if self.kv_transfer is not None and kt and kt.get("do_remote_decode") and reason != "abort":
                self.kv_transfer.pin(seq)
            self.scheduler.finish(seq)

    def _capture_routing(self, seq: Sequence) -> None:
        """Read the sequence's expert rows out of the pool before its blocks are freed."""
        if self.runner.routing is not None:
            seq.routed_experts = self.runner.routing.read(seq.block_table, seq.num_computed_tokens)

    def _forget(self, req: Request) -> None:
        reqs = self.requests.get(req.request_id)
        if reqs is not None and req in reqs:
            reqs.remove(req)
            if not reqs:
                del self.requests[req.request_id]

    def _cache_key(self, req: Request) -> bytes:
        return extra_key(
            self.weight_generation, req.adapter, self.adapter_generations.get(req.adapter or "", 0), req.cache_salt
        )
