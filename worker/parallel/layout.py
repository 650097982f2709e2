"""Rank order and head ownership of a worker group (Shift §3.2.2, §3.3.1, Fig. 7).

World size G = SP x TP. TP groups are contiguous ranks, SP groups are strided, so global rank r
has ``tp_rank = r % TP`` and ``sp_rank = r // TP``. In the base gear TP shards heads over the TP
group and Ulysses' all-to-all then splits each TP shard over the SP group: rank (s, t) ends up with
head block ``t * SP + s``. The shift gear runs TP over all G ranks in SP_TP order — the SP groups
concatenated — which gives every rank that same block, so both gears read and write the same KV
cache (KV cache invariance).

KV heads follow the same rule; when a group has more ranks than KV heads, each KV head is held by
``G / kv_heads`` consecutive blocks (TP replicates them by loading, Ulysses by Alg. 1).

With pipeline parallelism (PP > 1) the world is PP stages of SP x TP ranks each, stage-major:
rank r sits in stage ``r // (SP x TP)`` at stage-local rank ``r % (SP x TP)``, and every rule
above applies to the stage-local rank within its stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.worker.errors import InvalidRequestError


@dataclass(frozen=True)
class Layout:
    """(SP, TP) over ``sp * tp`` ranks per stage, ``pp`` stages; pure arithmetic, no groups."""

    sp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("sp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(name, f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def stage_size(self) -> int:
        """Ranks in one pipeline stage (all of them without PP)."""
        return self.sp * self.tp

    @property
    def world_size(self) -> int:
        return self.pp * self.sp * self.tp

    def collectives(self) -> tuple[str, ...]:
        """The collectives this layout's steps run (parallel/collective_timing.py's names): TP's
        all-reduces, Ulysses' all-to-alls and KV all-gather (Alg. 1), PP's activation sends."""
        used: tuple[str, ...] = ("all_reduce",) if self.tp > 1 else ()
        used += ("all_to_all", "all_gather") if self.sp > 1 else ()
        return used + (("send_recv",) if self.pp > 1 else ())

    def stage(self, rank: int) -> int:
        return rank // self.stage_size

    def local_rank(self, rank: int) -> int:
        """The rank's index inside its stage."""
        return rank % self.stage_size

    def tp_rank(self, rank: int) -> int:
        return self.local_rank(rank) % self.tp

    def sp_rank(self, rank: int) -> int:
        return self.local_rank(rank) // self.tp

    def _in_stage(self, stage: int, local: list[list[int]]) -> list[list[int]]:
        base = stage * self.stage_size
        return [[base + r for r in group] for group in local]

    def tp_groups(self) -> list[list[int]]:
        """Contiguous: [[0, 1], [2, 3], [4, 5]] for SP 3, TP 2 (each stage in turn)."""
        local = [[s * self.tp + t for t in range(self.tp)] for s in range(self.sp)]
        return [g for st in range(self.pp) for g in self._in_stage(st, local)]

    def sp_groups(self) -> list[list[int]]:
        """Strided: [[0, 2, 4], [1, 3, 5]] for SP 3, TP 2 (each stage in turn)."""
        local = [[s * self.tp + t for s in range(self.sp)] for t in range(self.tp)]
        return [g for st in range(self.pp) for g in self._in_stage(st, local)]

    def sp_tp_order(self, stage: int = 0) -> list[int]:
        """The shift gear's TP order, SP groups concatenated: [0, 2, 4, 1, 3, 5] (§3.3.2)."""
        per_stage = self.tp  # SP groups per stage
        groups = self.sp_groups()[stage * per_stage : (stage + 1) * per_stage]
        return [r for group in groups for r in group]

    def pp_peers(self) -> list[list[int]]:
        """Ranks at the same stage-local position, one per stage: a pipeline's path."""
        return [
            [st * self.stage_size + local for st in range(self.pp)]
            for local in range(self.stage_size)
        ]

    def head_block(self, rank: int) -> int:
        """Index of the block of ``heads / G`` query heads this rank attends over, in both gears."""
        return self.tp_rank(rank) * self.sp + self.sp_rank(rank)

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        return max(1, num_kv_heads // self.stage_size)

    def kv_head_start(self, rank: int, num_kv_heads: int) -> int:
        """First KV head (of ``kv_heads_per_rank``) this rank holds in its cache."""
        block = self.head_block(rank)
        g = self.stage_size
        if g <= num_kv_heads:
            return block * (num_kv_heads // g)
        return block // (g // num_kv_heads)

    def check_model(self, num_heads: int, num_kv_heads: int, num_layers: int = 1) -> None:
        """Refuse layouts whose heads or layers do not split evenly, naming the sizes involved."""
        if self.pp > num_layers:
            raise InvalidRequestError("pp", f"pp {self.pp} exceeds the model's {num_layers} layers")
        g = self.stage_size
        if num_heads % g:
            raise InvalidRequestError(
                "world_size", f"{num_heads} attention heads do not split over sp x tp = {g} ranks"
            )
        for name, size in (("tp", self.tp), ("world_size", g)):
            if size >= num_kv_heads and size % num_kv_heads:
                raise InvalidRequestError(
                    name, f"{name} {size} is not a multiple of the {num_kv_heads} KV heads"
                )
            if size < num_kv_heads and num_kv_heads % size:
                raise InvalidRequestError(
                    name, f"{num_kv_heads} KV heads do not split over {name} {size}"
                )


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Global layer indices of ``stage``: as even as possible, earlier stages take the remainder
    (the last stage also runs the LM head, the largest single matmul of a small model)."""
    if pp > num_layers:
        raise InvalidRequestError(
            "pp", f"pp {pp} exceeds the model's {num_layers} layers (every stage needs one)"
        )
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))
