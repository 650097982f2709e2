"""What a simulation reports: per-request timelines and the aggregate figures of the run."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gearshift.operator.sim.replica import RequestTimes, SimReplica


@dataclass(frozen=True)
class SimResult:
    """Finished requests in trace order, refusals, and per-replica step counts and busy time."""

    requests: list[RequestTimes]
    rejected: list[tuple[int, str]]
    steps: list[int]
    busy_s: list[float]
    preemptions: int

    @staticmethod
    def of(
        done: list[RequestTimes], rejected: list[tuple[int, str]], replicas: list[SimReplica]
    ) -> SimResult:
        """The result of a run whose engines were ``replicas`` (requests put in trace order)."""
        done.sort(key=lambda r: int(r.request_id[1:]))
        return SimResult(
            requests=done,
            rejected=rejected,
            steps=[r.steps for r in replicas],
            busy_s=[r.busy_s for r in replicas],
            preemptions=sum(r.scheduler.num_preemptions for r in replicas),
        )

    @property
    def makespan(self) -> float:
        """First arrival to last token (seconds)."""
        if not self.requests:
            return 0.0
        return max(r.finished for r in self.requests) - min(r.arrival for r in self.requests)

    @property
    def output_throughput(self) -> float:
        """Generated tokens per second over the makespan."""
        span = self.makespan
        return sum(r.output_tokens for r in self.requests) / span if span > 0 else 0.0

    @property
    def total_throughput(self) -> float:
        """Prompt plus generated tokens per second over the makespan."""
        span = self.makespan
        tokens = sum(r.prompt_tokens + r.output_tokens for r in self.requests)
        return tokens / span if span > 0 else 0.0

    def ttft(self, q: float) -> float:
        return float(np.percentile([r.ttft for r in self.requests], q))

    def tpot(self, q: float) -> float:
        values = [t for r in self.requests if (t := r.tpot) is not None]
        return float(np.percentile(values, q)) if values else 0.0

    def e2e(self, q: float) -> float:
        return float(np.percentile([r.e2e for r in self.requests], q))

    def summary(self) -> dict[str, float]:
        """The headline figures (seconds, tokens/s)."""
        return {
            "requests": len(self.requests),
            "rejected": len(self.rejected),
            "makespan_s": self.makespan,
            "output_tokens_per_s": self.output_throughput,
            "total_tokens_per_s": self.total_throughput,
            "ttft_mean_s": float(np.mean([r.ttft for r in self.requests])),
            "ttft_p50_s": self.ttft(50),
            "ttft_p99_s": self.ttft(99),
            "tpot_p50_s": self.tpot(50),
            "tpot_p99_s": self.tpot(99),
            "e2e_p50_s": self.e2e(50),
            "preemptions": self.preemptions,
        }
