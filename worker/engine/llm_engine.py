"""The leader's engine: admit requests, run scheduled steps, stream outputs.

Each ``step`` keeps up to ``policy.micro_batches()`` steps in flight (pipeline micro-batches over
disjoint sets of sequences) and finishes the oldest: samples from its logits and reports every
request that progressed. With one micro-batch (no pipeline) a step is scheduled, run and sampled
within one call, as before.

Not thread-safe: one thread drives ``add_request``/``abort_request``/``step`` (the worker server
funnels its RPCs into that thread).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.contract import LeaderPolicy, QueueView
from gearshift.worker.engine.model_runner import Executor, StepHandle
from gearshift.worker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from gearshift.worker.engine.plan import StepPlan, build_plan
from gearshift.worker.engine.prompt_logprobs import take_prompt_logprobs
from gearshift.worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from gearshift.worker.engine.sequence import FinishReason, Sequence
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.kv.block_manager import BlockManager
from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.sampling.params import InvalidSamplingParams, SamplingParams
from gearshift.worker.sampling.sampler import Sampler, SamplingState
from gearshift.worker.step_phases import StepPhases
from gearshift.worker.structured import GrammarCompiler, GrammarMatcher, InvalidGrammar
from gearshift.worker.tokenizer.detokenizer import IncrementalDetokenizer
from gearshift.worker.tokenizer.stop import StopChecker
from gearshift.worker.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaLoad:
    """One engine's load inside a group of engine replicas (routing: WorkerStats.replicas)."""

    running: int
    waiting: int
    outstanding_tokens: int


@dataclass(frozen=True)
class InstanceLoad:
    """One instance of a group with roles (Tetris: WorkerStats.instances), for the planner."""

    role: str  # "prefill" or "decode"
    index: int
    queued_seconds: float  # prefill: the planned end of the work it still has (T_k)
    kv_slots_free: int  # decode: free KV token slots
    kv_slots_reserved: int  # decode: slots held by requests still in transfer
    batch_size: int  # decode: running requests
    node: int = 0  # the node (pod of the group) it runs on
    kv_slots_total: int = 0  # decode: KV token slots when empty (0: not known yet)


@dataclass
class EngineStats:
    """A snapshot for GetStats and metrics."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_usage: float
    outstanding_tokens: int
    num_preemptions: int
    prefix_cache_hit_tokens: int
    steps: int
    prompt_tokens: int
    generation_tokens: int
    # KV tokens discarded by preemptions (recomputed on re-admission, less prefix hits).
    preempted_tokens: int = 0
    gear_steps: dict[str, int] = field(default_factory=dict)
    gear_tokens: dict[str, int] = field(default_factory=dict)
    gear: str = ""
    gear_switches: int = 0
    policy_stats: dict[str, float] = field(default_factory=dict)  # Policy.stats()
    # The leader's host seconds per finished step, by phase (step_phases.PHASES).
    step_phases: dict[str, float] = field(default_factory=dict)
    replicas: list[ReplicaLoad] = field(default_factory=list)  # a replica group's engines
    instances: list[InstanceLoad] = field(default_factory=list)  # a group with roles (Tetris)


@dataclass
class _TextState:
    detok: IncrementalDetokenizer
    stop: StopChecker | None


@dataclass
class _InFlight:
    """A submitted step and the batch it runs."""

    batch: ScheduledBatch
    plan: StepPlan
    handle: StepHandle

    @property
    def seqs(self) -> list[Sequence]:
        return self.batch.decodes + [s for s, _ in self.batch.prefills]


class LLMEngine:
    """Leader-side engine over an executor (one process, or a multi-rank group's leader)."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        blocks: BlockManager,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        tokenizer: Tokenizer | None,
        policy: LeaderPolicy,
        phases: StepPhases | None = None,
    ) -> None:
        """``phases``: where the step's host time is added up (shared with a group executor,
        which adds the broadcast); a new one by default."""
        self.config = config
        self.executor = executor
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len),
            blocks,
        )
        self.phases = phases if phases is not None else StepPhases()
        self.sampler = Sampler(phases=self.phases)
        self.grammars = (
            GrammarCompiler(tokenizer, vocab_size, eos_token_ids) if tokenizer is not None else None
        )
        self.policy = policy
        policy.bind(self.scheduler, blocks)
        self.in_flight: deque[_InFlight] = deque()
        self._aborted: set[str] = set()  # aborts of in-flight requests, done when their step ends
        self._failed: list[RequestOutput] = []  # outputs of a failure, reported by the next step
        self.requests: dict[str, Sequence] = {}
        self._text: dict[str, _TextState] = {}
        self._ids = itertools.count()
        self._step = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.gear_steps = dict.fromkeys(self.policy.gear_names, 0)
        self.gear_tokens = dict.fromkeys(self.policy.gear_names, 0)
        self.gear_switches = 0
        self.current_gear = 0
        self.dead: str | None = None  # why the worker group can no longer run steps

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this engine has no tokenizer; send token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises InvalidRequestError naming the bad field and changes nothing."""
        params = params or SamplingParams()
        if self.dead is not None:
            raise GroupFailure(self.dead)
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"request id {request_id!r} is already running")
        ids = self.tokenize(prompt)
        self._check_prompt(ids, params)
        params.check_vocabulary(self.vocab_size)
        grammar = self._grammar(params)
        room = self.max_model_len - len(ids)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            max_tokens=room if params.max_tokens is None else params.max_tokens,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            generator=torch.Generator().manual_seed(params.seed)
            if params.seed is not None
            else None,
            grammar=grammar,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            cache_salt=params.cache_salt,
        )
        if self.tokenizer is not None and self.config.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens
            )
            stop = (
                StopChecker(params.stop, params.include_stop_str_in_output) if params.stop else None
            )
            self._text[request_id] = _TextState(detok, stop)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _grammar(self, params: SamplingParams) -> GrammarMatcher | None:
        """The structured-output matcher of a new sequence (it lives on the leader only)."""
        if params.structured is None:
            return None
        if self.grammars is None:
            raise InvalidSamplingParams(
                "structured_outputs", "structured outputs need the tokenizer, which is not loaded"
            )
        try:
            return self.grammars.matcher(params.structured)
        except InvalidGrammar as exc:
            raise InvalidSamplingParams("structured_outputs", str(exc)) from None

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("prompt", "prompt is empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                "prompt", f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, which leaves no room to generate",
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"asks for {len(ids) + params.max_tokens} ({len(ids)} in the prompt, "
                f"{params.max_tokens} in max_tokens)",
            )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished.

        A request whose step is in flight stops now for the caller (no more outputs); its blocks
        are freed when that step ends, so no stage writes into blocks someone else holds.
        """
        if request_id in self._busy():
            self._aborted.add(request_id)
            self._forget(request_id)
            return True
        seq = self.scheduler.abort(request_id)
        self._forget(request_id)
        return seq is not None

    def _busy(self) -> frozenset[str]:
        return frozenset(s.request_id for f in self.in_flight for s in f.seqs)

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._text.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.in_flight) or bool(self._failed)

    def keepalive(self) -> None:
        """Call every few seconds while idle: keeps a multi-rank group's followers alive."""
        if self.dead is None:
            self.executor.keepalive()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Submit steps until the policy's micro-batches are in flight, then finish the oldest:
        sample from its logits and report every request that progressed."""
        if self._failed:
            failed, self._failed = self._failed, []
            return failed
        depth = max(1, self.policy.micro_batches())
        while len(self.in_flight) < depth and self.dead is None:
            if not self._launch():
                break
        if self._failed:
            failed, self._failed = self._failed, []
            return failed
        if not self.in_flight:
            return []
        return self._finish(self.in_flight.popleft())

    def _launch(self) -> bool:
        """Schedule and submit one step; False when there is nothing to run."""
        phases = self.phases
        start = time.perf_counter()
        queues = QueueView(
            len(self.scheduler.running), len(self.scheduler.waiting), len(self.in_flight)
        )
        request = self.policy.step_request(queues)
        batch = self.scheduler.schedule(request, self._busy() | self.policy.held())
        sections = self.policy.plan_sections(batch)
        if batch.is_empty and not sections:
            return False
        gear = self.policy.choose_gear(batch)
        planned = time.perf_counter()
        phases.add("schedule", planned - start)
        if gear != self.current_gear:
            # The first step picks a gear; only later changes are switches.
            self.gear_switches += self._step > 0
            self.current_gear = gear
        depth = max(1, self.policy.micro_batches())
        plan = build_plan(
            batch,
            self.blocks,
            self._step,
            gear,
            pad_to=self.policy.pad_multiple(gear),
            micro_batch=self._step % depth,
        )
        for name, values in sections.items():
            plan = plan.with_section(name, values)
        self._step += 1
        name = self.policy.gear_names[gear]
        self.gear_steps[name] += 1
        self.gear_tokens[name] += batch.num_tokens
        broadcast = phases.seconds["broadcast"]
        submit = time.perf_counter()
        phases.add("plan", submit - planned)
        try:
            handle = self.executor.submit(plan)
            # Forward launch: the submit less the plan's broadcast (a group executor's share).
            sent = phases.seconds["broadcast"] - broadcast
            phases.add("forward", time.perf_counter() - submit - sent)
            self.policy.step_submitted()
        except GroupFailure as exc:
            self._die(exc)
            return False
        except Exception as exc:  # a failed forward ends its requests, not the engine
            log.exception("forward pass failed at step %d", plan.step)
            scheduled = batch.decodes + [s for s, _ in batch.prefills]
            self._failed += [self._fail(seq, f"forward pass failed: {exc}") for seq in scheduled]
            return False
        self.in_flight.append(_InFlight(batch, plan, handle))
        return True

    def _die(self, exc: GroupFailure) -> None:
        """The group is gone: every request ends now with the reason, none hangs."""
        log.error("%s", exc)
        self.dead = str(exc)
        everyone = list(self.scheduler.running) + list(self.scheduler.waiting)
        self.scheduler.waiting.clear()
        self.in_flight.clear()
        self._failed += [
            self._fail(seq, str(exc)) for seq in everyone if seq.request_id not in self._aborted
        ]
        for rid in list(self._aborted):
            self.scheduler.abort(rid)
        self._aborted.clear()

    def _finish(self, flight: _InFlight) -> list[RequestOutput]:
        batch = flight.batch
        try:
            logits = flight.handle.result()
        except GroupFailure as exc:
            self._die(exc)
            failed, self._failed = self._failed, []
            return failed
        except Exception as exc:
            log.exception("forward pass failed at step %d", flight.plan.step)
            return [self._fail(seq, f"forward pass failed: {exc}") for seq in flight.seqs]
        self.phases.steps += 1
        logits = take_prompt_logprobs(logits, batch)
        sampling: list[Sequence] = []
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
            sampling.append(seq)
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            self.prompt_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                sampling.append(seq)
        for seq in [*batch.decodes, *(s for s, _ in batch.prefills)]:
            self.blocks.cache_full_blocks(
                seq.blocks, seq.token_ids, seq.num_computed_tokens, seq.cache_salt
            )
        outputs = self._sample_and_process(sampling, logits)
        if self._aborted:
            aborted = {s.request_id for s in flight.seqs} & self._aborted
            for rid in aborted:
                self.scheduler.abort(rid)
            self._aborted -= aborted
            outputs = [o for o in outputs if o.request_id not in aborted]
        self.scheduler.remove_finished()
        return outputs

    def _sample_and_process(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> list[RequestOutput]:
        if not seqs:
            return []  # a step that only moved KV (plan_sections) samples nothing
        eos = self.eos_token_ids
        states = [
            SamplingState(
                s.params, s.generator, s.prompt_token_ids, s.output_token_ids, eos, s.grammar
            )
            for s in seqs
        ]
        sampled = self.sampler.sample(logits, states)
        start = time.perf_counter()
        now = time.monotonic()
        outputs = []
        for i, seq in enumerate(seqs):
            token = sampled.token_ids[i]
            lp = sampled.logprobs[i]
            outputs.append(self._process(seq, token, lp, now))
        self.generation_tokens += len(seqs)
        self.phases.add("outputs", time.perf_counter() - start)
        return outputs

    def _process(
        self, seq: Sequence, token: int, logprob: TokenLogprobs | None, now: float
    ) -> RequestOutput:
        seq.append_token(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        params = seq.params
        reason: FinishReason | None = None
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                reason = FinishReason.STOP
            elif token in params.stop_token_ids:
                reason, seq.stop_reason = FinishReason.STOP, token
        if reason is None and (
            seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        text = ""
        state = self._text.get(seq.request_id)
        if state is not None:
            text = state.detok.step([token])
            if reason is not None:
                text += state.detok.flush()
            # Stop strings count only once min_tokens is reached, like stop tokens.
            if state.stop is not None and seq.num_output_tokens >= params.min_tokens:
                result = state.stop.feed(text)
                text = result.text
                if result.stopped:
                    reason, seq.stop_reason = FinishReason.STOP, result.stop_str
                elif reason is not None:
                    text += state.stop.flush()
        out = self._output(seq, [token], text, [logprob] if logprob is not None else None)
        if seq.num_output_tokens == 1:
            out.prompt_logprobs = seq.prompt_logprobs
        if reason is not None:
            self.scheduler.finish(seq, reason)
            out.finished, out.finish_reason, out.stop_reason = True, reason, seq.stop_reason
            out.metrics = self._metrics(seq, now)
            self._forget(seq.request_id)
        return out

    def _output(
        self, seq: Sequence, tokens: list[int], text: str, logprobs: list[TokenLogprobs] | None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_text=text,
            finished=False,
            finish_reason=None,
            stop_reason=None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=self._metrics(seq, None),
            new_logprobs=logprobs,
        )

    @staticmethod
    def _metrics(seq: Sequence, finished: float | None) -> RequestMetrics:
        return RequestMetrics(
            seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, finished
        )

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        self.scheduler.finish(seq, FinishReason.ERROR)
        self.scheduler.remove_finished()
        self._forget(seq.request_id)
        out = self._output(seq, [], "", None)
        out.finished, out.finish_reason, out.error = True, FinishReason.ERROR, message
        return out

    # ---- offline --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run prompts to completion; all prompts are validated before any is queued."""
        plist = (
            list(params) if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
        )
        if len(plist) != len(prompts):
            raise InvalidRequestError("params", f"{len(plist)} params for {len(prompts)} prompts")
        tokenized = [self.tokenize(p) for p in prompts]
        for ids, p in zip(tokenized, plist, strict=True):
            self._check_prompt(ids, p)
        rids = [f"generate-{next(self._ids)}" for _ in prompts]
        results = {
            rid: CompletionOutput(rid, ids, logprobs=[] if p.logprobs is not None else None)
            for rid, ids, p in zip(rids, tokenized, plist, strict=True)
        }
        for rid, ids, p in zip(rids, tokenized, plist, strict=True):
            self.add_request(rid, ids, p)
        pending = set(rids)
        while pending:
            for out in self.step():
                res = results.get(out.request_id)
                if res is None:
                    continue
                res.token_ids.extend(out.new_token_ids)
                res.text += out.new_text
                if res.logprobs is not None and out.new_logprobs:
                    res.logprobs.extend(out.new_logprobs)
                if out.finished:
                    res.finish_reason, res.stop_reason = out.finish_reason, out.stop_reason
                    res.num_cached_tokens = out.num_cached_tokens
                    pending.discard(out.request_id)
        return [results[r] for r in rids]

    def stats(self) -> EngineStats:
        running = self.scheduler.running
        outstanding = sum(
            s.num_tokens - s.num_computed_tokens + s.max_tokens - s.num_output_tokens
            for s in running
        )
        outstanding += sum(
            s.num_tokens + s.max_tokens - s.num_output_tokens for s in self.scheduler.waiting
        )
        used = self.blocks.num_blocks - self.blocks.num_free_blocks
        return EngineStats(
            num_running=len(running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_used=used,
            kv_usage=self.blocks.usage,
            outstanding_tokens=outstanding,
            num_preemptions=self.scheduler.num_preemptions,
            preempted_tokens=self.scheduler.preempted_tokens,
            prefix_cache_hit_tokens=self.blocks.prefix_hit_tokens,
            steps=self._step,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            gear_steps=dict(self.gear_steps),
            gear_tokens=dict(self.gear_tokens),
            gear=self.policy.gear_names[self.current_gear],
            gear_switches=self.gear_switches,
            policy_stats=self.policy.stats(),
            step_phases=self.phases.per_step(),
        )

    def shutdown(self) -> None:
        # Steps in flight finish first: no stage may still be sending when the group closes.
        while self.in_flight and self.dead is None:
            self._finish(self.in_flight.popleft())
        for rid in list(self.requests):
            self.abort_request(rid)
        self.executor.shutdown()
