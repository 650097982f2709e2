"""Decode steps replayed from captured graphs, per gear and batch-size bucket, over static inputs.

A decode-only step of a gear that has graphs runs this way (the design of nano-vllm's and vLLM's
runners; STYLE.md: capture lives in the runner, not in the model):

1. Its ``n`` sequences take the smallest bucket ``N >= n`` (1, 2, 4, 8, then every 16 up to the
   largest; each a multiple of the gear's SP size, since Ulysses splits the tokens evenly).
2. The plan is copied into the rank's static inputs: one int64 vector holding the bucket's token
   ids, positions, KV slots and sequence lengths (one host-to-device copy), and the first ``w``
   block-table columns of the ``n`` rows. Rows ``n..N`` are padding: token 0 at position 0, slot
   -1 (no KV is written), length 1 (attention reads position 0 of the block in the row's first
   column: stale, but a block id of this cache). Every layer treats rows independently, so no real
   row sees a padding row.
3. The bucket's graph replays the gear's whole forward over those inputs (with its collectives:
   TP all-reduce, Ulysses all-to-all, the logits gather) into a static logits buffer; the first
   ``n`` rows are the step's logits.

Prefill and mixed steps, steps of more sequences than the largest bucket or with more block-table
columns than the static tables, and gears the policy keeps eager run eagerly (``bucket_for`` says
None). A captured step's attention metadata is static: its decode length bound is the tables'
whole width, so a backend sizes its work from shapes, never from this step's lengths.

Capture is ``torch.cuda.CUDAGraph`` on a GPU (largest bucket first, one memory pool for every
gear and bucket: steps never overlap). Elsewhere ``DirectGraph`` stands in: "capture" keeps the
call and where everything it reads lives; "replay" calls it again, refusing if a static buffer,
the KV cache or a weight has moved since capture, and under ``NoHostSync``, so a step that reads
a device value on the host fails on the CPU as it would fail to capture on a GPU.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.engine.host_sync import NoHostSync
from gearshift.worker.kv.cache import LayerKV

if TYPE_CHECKING:
    from gearshift.worker.engine.model_runner import Gear
    from gearshift.worker.engine.plan import StepPlan

log = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16

# (gear, token ids, positions, KV caches, metadata) -> logits of every row, or None on a rank
# that does not make them: ModelRunner.forward, the same code eager steps run.
Forward = Callable[["Gear", torch.Tensor, torch.Tensor, list[LayerKV], AttentionMetadata], Any]


class GraphEscape(RuntimeError):
    """A replay would read memory other than what its graph was captured on."""


def bucket_sizes(max_batch: int, multiple: int = 1) -> tuple[int, ...]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 16 below ``max_batch``, and
    ``max_batch``; each rounded up to a multiple of ``multiple`` (the gear's SP size)."""
    if max_batch < 1:
        return ()
    sizes = [n for n in SMALL_BUCKETS if n < max_batch]
    sizes += [*range(BUCKET_STEP, max_batch, BUCKET_STEP), max_batch]
    return tuple(sorted({-(-n // multiple) * multiple for n in sizes}))


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Host values into a device buffer, queued (pinned, non-blocking): the host never waits."""
    if dst.is_cuda and src.is_cpu:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


class StaticInputs:
    """The rank's static buffers: every gear's graphs read and write these, plans are copied in.

    ``vectors`` holds, for a bucket of ``N`` rows, ids | positions | slots | lengths in its first
    ``4N`` entries (each graph views its own bucket's layout); ``tables`` is [max batch, width].
    """

    def __init__(
        self,
        max_batch: int,
        width: int,
        device: torch.device,
        logits: tuple[int, torch.dtype] | None,
    ) -> None:
        self.max_batch = max_batch
        self.width = width
        self.vectors = torch.zeros(4 * max_batch, dtype=torch.int64, device=device)
        self.tables = torch.zeros(max_batch, width, dtype=torch.int64, device=device)
        # [max batch, vocab] on a rank that makes logits (None elsewhere).
        self.logits = (
            torch.zeros(max_batch, logits[0], dtype=logits[1], device=device)
            if logits is not None
            else None
        )
        self.pad(max_batch)

    @property
    def nbytes(self) -> int:
        held = [self.vectors, self.tables] + ([self.logits] if self.logits is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    def views(self, n: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots, lengths, tables) of a bucket of ``n`` rows."""
        v = self.vectors
        return v[:n], v[n : 2 * n], v[2 * n : 3 * n], v[3 * n : 4 * n], self.tables[:n]

    def pad(self, n: int) -> None:
        """Every row of bucket ``n`` a padding row (what warm-up and capture run on)."""
        host = torch.tensor([0] * (2 * n) + [-1] * n + [1] * n, dtype=torch.int64)
        _copy_in(self.vectors[: 4 * n], host)

    def load(self, plan: StepPlan, n: int) -> None:
        """Copy decode-only ``plan`` into bucket ``n``'s inputs, rows past the plan padded."""
        nd = plan.num_decodes
        host = np.empty(4 * n, dtype=np.int64)
        for k, (values, fill) in enumerate(
            ((plan.input_ids, 0), (plan.positions, 0), (plan.slot_mapping, -1), (plan.seq_lens, 1))
        ):
            host[k * n : k * n + nd] = values[:nd].numpy()
            host[k * n + nd : (k + 1) * n] = fill
        _copy_in(self.vectors[: 4 * n], torch.from_numpy(host))
        width = plan.block_tables.shape[1]
        if width:
            _copy_in(self.tables[:nd, :width], plan.block_tables)


@dataclass
class DirectGraph:
    """A graph's stand-in off CUDA: replay calls ``fn`` again, as a GPU would replay its kernels,
    but first checks that everything ``watched`` still lives where it did at capture."""

    fn: Callable[[], Any]
    watched: list[torch.Tensor]
    where: list[tuple[int, tuple[int, ...], tuple[int, ...]]]

    @classmethod
    def capture(cls, fn: Callable[[], Any], watched: list[torch.Tensor]) -> DirectGraph:
        graph = cls(fn, watched, [])
        graph.where = graph._where()
        return graph

    def _where(self) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        return [(t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in self.watched]

    def replay(self) -> Any:
        """``fn()``, refused (GraphEscape) if what it reads moved, and failing (HostSyncError)
        where it reads a device value on the host."""
        now = self._where()
        if now != self.where:
            moved = sum(a != b for a, b in zip(now, self.where, strict=True))
            raise GraphEscape(
                f"{moved} tensor(s) a graph reads (static inputs, KV cache or weights) moved or "
                "changed shape since capture"
            )
        with NoHostSync("a decode step replayed from a graph"):
            return self.fn()


class DecodeGraphs:
    """This rank's decode graphs: per gear, one per bucket, all over one ``StaticInputs``."""

    def __init__(
        self, inputs: StaticInputs, buckets: dict[int, tuple[int, ...]], block_size: int
    ) -> None:
        self.inputs = inputs
        self.buckets = buckets  # gear index -> its bucket sizes (gears absent run eagerly)
        self.block_size = block_size
        self.graphs: dict[tuple[int, int], Any] = {}
        self.makes_logits: dict[int, bool] = {}
        self.pool: Any = None  # the CUDA graphs' shared memory pool
        self.replays: Counter[tuple[int, int]] = Counter()  # (gear, bucket) -> steps replayed
        self.eager_decodes = 0  # decode-only steps of a graphed gear that ran eagerly
        self._static = self._static_where()  # graphs read these buffers, wherever they run

    def _static_where(self) -> list[int]:
        held = [self.inputs.vectors, self.inputs.tables, self.inputs.logits]
        return [t.data_ptr() if t is not None else 0 for t in held]

    @property
    def max_bucket(self) -> int:
        return max((max(b) for b in self.buckets.values() if b), default=0)

    def metadata(self, n: int) -> AttentionMetadata:
        """Bucket ``n``'s attention view of the static inputs; the decode length bound is the
        tables' width, a shape (what a captured kernel may size its work from)."""
        _, _, slots, lens, tables = self.inputs.views(n)
        return AttentionMetadata(
            num_decodes=n,
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=lens,
            max_decode_seq_len=self.inputs.width * self.block_size,
            prefill_starts=(),
            prefill_query_lens=(),
            prefill_seq_lens=(),
        )

    def run_fn(self, forward: Forward, gear: Gear, kv: list[LayerKV], n: int) -> Callable[[], bool]:
        """Bucket ``n``'s step as one call (what a graph holds): True when it made logits."""
        ids, positions, *_ = self.inputs.views(n)
        meta = self.metadata(n)
        out = self.inputs.logits

        def step() -> bool:
            logits = forward(gear, ids, positions, kv, meta)
            if logits is None:
                return False
            assert out is not None, "logits on a rank that reserved no buffer for them"
            out[:n].copy_(logits)
            return True

        return step

    def capture(
        self,
        index: int,
        gear: Gear,
        kv: list[LayerKV],
        forward: Forward,
        watched: list[torch.Tensor],
        cuda: bool,
    ) -> None:
        """Capture every bucket of gear ``index``, largest first (the pool then fits them all).

        ``watched``: the KV cache and weights the graphs read (checked at replay off CUDA)."""
        statics = [self.inputs.vectors, self.inputs.tables]
        if self.inputs.logits is not None:
            statics.append(self.inputs.logits)
        for n in sorted(self.buckets.get(index, ()), reverse=True):
            step = self.run_fn(forward, gear, kv, n)
            self.inputs.pad(n)
            if cuda:
                self.graphs[(index, n)] = self._capture_cuda(step, index)
            else:
                graph = DirectGraph.capture(step, statics + watched)
                self.makes_logits[index] = graph.replay()  # a GPU's warm-up run, checked
                self.graphs[(index, n)] = graph

    def _capture_cuda(self, step: Callable[[], bool], index: int) -> Any:
        # Warm-up outside the capture: lazy set-up (cuBLAS workspaces, Triton compilation, NCCL
        # communicators) must not happen while capturing.
        self.makes_logits[index] = step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a policy's copy threads (their own streams) may use CUDA meanwhile.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step()
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    def bucket_for(self, plan: StepPlan) -> int | None:
        """The bucket that replays ``plan``; None runs it eagerly (module docstring)."""
        buckets = self.buckets.get(plan.gear)
        nd = plan.num_decodes
        if not buckets or plan.prefill_query_lens or nd == 0 or nd != plan.num_seqs:
            return None  # no graphs for this gear, or not a decode-only step
        if int(plan.logits_indices.shape[0]) != nd:
            return None
        if int(plan.block_tables.shape[1]) > self.inputs.width or nd > buckets[-1]:
            self.eager_decodes += 1
            return None
        return next(b for b in buckets if b >= nd)

    def replay(self, plan: StepPlan, n: int) -> torch.Tensor | None:
        """Run decode-only ``plan`` through bucket ``n``'s graph: its logits rows, or None on a
        rank that does not make logits."""
        if self._static_where() != self._static:
            raise GraphEscape("the static inputs were reallocated after their graphs' capture")
        self.inputs.load(plan, n)
        self.graphs[(plan.gear, n)].replay()
        self.replays[(plan.gear, n)] += 1
        if not self.makes_logits.get(plan.gear, False):
            return None
        assert self.inputs.logits is not None
        # A copy: the buffer belongs to the next replay, the logits to this step's sampler.
        return self.inputs.logits[: plan.num_decodes].clone()
