"""What ``gearshift plan`` compares (issue 16, item 3): every legal policy × layout × data-parallel
replica count of a model on some hardware, each with its step cost and KV capacity.

A candidate source is a function ``(model, hardware, settings) -> list[Candidate]``; ``SOURCES``
holds them by policy kind, so a technique whose simulated cost exists adds its candidates with one
registration line. The built-in source covers what ``roofline.py`` prices: static one-rank / TP /
Ulysses SP / PP and Shift, every degree that divides the device count and the model's heads (PP:
its layers), with replicas filling the devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.sim.hardware import Hardware, with_count
from gearshift.operator.sim.model_desc import ModelDesc, StageShares
from gearshift.operator.sim.replica import ReplicaConfig, SimHooks, StepAsk
from gearshift.operator.sim.results import SimResult
from gearshift.operator.sim.roofline import Layout, LayoutError, RooflineCost, check
from gearshift.operator.sim.sidp_cost import SidpCost, rank_bytes
from gearshift.operator.sim.sidp_cost import shapes as sidp_shapes
from gearshift.operator.sim.simulator import Deployment
from gearshift.operator.sim.trace import TraceRequest
from gearshift.worker.engine.contract import pipeline_share

MEMORY_UTILIZATION = 0.9  # of each device's memory for weights and KV (vLLM's default)


@dataclass(frozen=True)
class PlanSettings:
    """The engine settings every candidate is simulated with (``EngineConfig``'s names)."""

    max_model_len: int = 32768
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    memory_utilization: float = MEMORY_UTILIZATION


@dataclass(frozen=True)
class Candidate:
    """One deployment: groups of ``gpus_per_group`` devices running ``policy`` (the CRD's
    ``spec.policy`` object); ``replicas`` engines the simulator routes over (one per group, or a
    SiDP group's dp) each with step cost ``cost`` and ``config``; ``kv_tokens`` KV per group."""

    name: str
    kind: str
    policy: dict[str, Any]
    gpus_per_group: int
    replicas: int
    cost: Any  # a StepCost
    config: ReplicaConfig
    kv_tokens: int
    micro_batches: int = 1
    stages: int = 1
    stage_shares: (
        tuple[float, ...] | StageShares
    ) = ()  # ModelDesc.stage_shares of a pipeline; (): equal
    step_request: StepAsk | None = None  # the policy's say before each step
    notes: dict[str, Any] = field(default_factory=dict)
    hooks: Callable[[], SimHooks] | None = None  # a policy that drives its own steps
    # A deployment that is not replicas behind the router's rule (Tetris: a prefill pool and
    # decode instances): simulates a whole trace itself; ``cost``/``config`` describe its engines.
    run: Callable[[Sequence[TraceRequest]], SimResult] | None = None
    # Settings that depend on the declared traffic (Tetris: the improvement-rate table over the
    # rates the plan sweeps): ``for_traffic(self, traffic, rates)`` is the candidate to simulate
    # and render instead.
    for_traffic: Callable[[Candidate, Any, Sequence[float]], Candidate] | None = None

    @property
    def gpus(self) -> int:
        """Devices in all: a group's times the groups (SiDP and Tetris: ``notes["groups"]``)."""
        return self.gpus_per_group * int(self.notes.get("groups", self.replicas))

    def deployment(self, replicas: int | None = None) -> Deployment:
        """What the simulator runs for it: ``replicas`` engines (default: its own)."""
        return Deployment(
            self.replicas if replicas is None else replicas,
            self.config,
            self.cost,
            self.step_request,
            micro_batches=self.micro_batches,
            stages=self.stages,
            stage_shares=self.stage_shares,
            hooks=self.hooks,
        )


Source = Callable[[ModelDesc, Hardware, PlanSettings], list[Candidate]]


def kv_tokens(
    model: ModelDesc, hw: Hardware, weight_fraction: float, kv_split: int, s: PlanSettings
) -> int:
    """KV tokens one group holds: each rank's memory left after its weights (``weight_fraction``
    of the model) over its share (1/``kv_split``) of a token's KV; 0 when the weights do not fit."""
    free = hw.device.memory_bytes * s.memory_utilization - model.weight_bytes() * weight_fraction
    per_token = model.kv_bytes_per_token() / kv_split
    return max(0, int(free // per_token))


def _layout_candidates(model: ModelDesc, hw: Hardware, s: PlanSettings) -> list[Candidate]:
    out = []
    for d in range(1, hw.count + 1):
        if hw.count % d:
            continue
        for kind in ("one",) if d == 1 else ("tp", "sp", "pp", "shift"):
            layout = Layout(kind, d)
            try:
                check(layout, model, hw)
            except LayoutError:
                continue
            policy: dict[str, Any]
            if kind == "one":
                weights, kv_split, policy = 1.0, 1, {"static": {}}
            elif kind == "tp":
                weights, kv_split, policy = 1 / d, d, {"static": {"tp": d}}
            elif kind == "sp":  # Ulysses: whole weights per rank, KV heads split
                weights, kv_split, policy = 1.0, d, {"static": {"sp": d}}
            elif kind == "pp":
                weights, kv_split, policy = 1 / d, d, {"static": {"pp": d}}
            else:  # Shift §3.3.2: the SP gear's whole weights plus the TP gear's 1/d shard
                weights, kv_split, policy = 1 + 1 / d, d, {"shift": {"sp": d, "tp": 1}}
            tokens = kv_tokens(model, hw, weights, kv_split, s)
            blocks = tokens // s.block_size
            if blocks * s.block_size < max(s.max_num_batched_tokens, s.max_model_len):
                continue  # too little KV left for one full step or one full-length request
            replicas = hw.count // d
            config = _config(blocks, s)
            name = str(layout) if replicas == 1 else f"{layout}x{replicas}"
            micro = d if kind == "pp" else 1
            out.append(
                Candidate(
                    name,
                    "shift" if kind == "shift" else "static",
                    policy,
                    d,
                    replicas,
                    RooflineCost(model, hw, layout),
                    config,
                    tokens,
                    micro_batches=micro,
                    stages=micro,
                    stage_shares=model.stage_shares(micro) if micro > 1 else (),
                    # The static policy's own rule for a pipeline's micro-batches.
                    step_request=functools.partial(pipeline_share, stages=micro),
                )
            )
    return out


def _config(blocks: int, s: PlanSettings) -> ReplicaConfig:
    return ReplicaConfig(
        num_blocks=blocks,
        block_size=s.block_size,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len,
    )


def _sidp_candidates(model: ModelDesc, hw: Hardware, s: PlanSettings) -> list[Candidate]:
    """SiDP groups of dp × tp GPUs on one node (sidp_cost.py); each of a group's dp engine
    replicas is a routing target of its own, so ``replicas`` counts engines, not groups."""
    out = []
    for tp, dp in sidp_shapes(model, hw.devices_per_node):
        gpus = dp * tp
        if hw.count % gpus:
            continue
        resident = rank_bytes(model, dp, tp).resident
        free = hw.device.memory_bytes * s.memory_utilization - resident
        tokens = max(0, int(free // (model.kv_bytes_per_token() / tp)))
        blocks = tokens // s.block_size
        if blocks * s.block_size < max(s.max_num_batched_tokens, s.max_model_len):
            continue
        groups = hw.count // gpus
        name = f"sidp{tp}x{dp}" + (f"x{groups}" if groups > 1 else "")
        out.append(
            Candidate(
                name,
                "sidp",
                {"sidp": {"dp": dp, "tp": tp}},
                gpus,
                groups * dp,
                SidpCost(model, hw, dp, tp),
                _config(blocks, s),
                tokens * dp,
                notes={"groups": groups, "engines_per_group": dp},
            )
        )
    return out


def _seesaw_candidates(model: ModelDesc, hw: Hardware, s: PlanSettings) -> list[Candidate]:
    """Seesaw groups of G GPUs on one node, PP G prefill -> TP G decode (seesaw_sim.py)."""
    # Imported here: the Seesaw leader imports torch, which `gearshift plan` otherwise avoids.
    from gearshift.operator.sim import seesaw_sim

    out = []
    for g in range(2, hw.devices_per_node + 1):
        if hw.count % g or model.heads % g or model.kv_heads % g or model.layers < g:
            continue
        tokens = kv_tokens(model, hw, 1 / g, g, s)  # one gear's weights resident at a time
        blocks = tokens // s.block_size
        if blocks * s.block_size < max(s.max_num_batched_tokens, s.max_model_len):
            continue
        groups = hw.count // g
        out.append(
            Candidate(
                f"seesaw{g}" + (f"x{groups}" if groups > 1 else ""),
                "seesaw",
                seesaw_sim.policy(g),
                g,
                groups,
                RooflineCost(model, with_count(hw, g), Layout("tp", g)),  # unused: hooks price
                _config(blocks, s),
                tokens,
                hooks=functools.partial(seesaw_sim.SeesawHooks, model, hw, g, s.block_size),
                stage_shares=model.stage_shares(g),  # the prefill gear's g pipeline stages
            )
        )
    return out


def _tetris_candidates(model: ModelDesc, hw: Hardware, s: PlanSettings) -> list[Candidate]:
    """Tetris groups filling one node or two (tetris_sim.py): P prefill instances of TP Tp (the
    smallest that holds the whole model) and D decode instances of TP T, P·Tp + D·T = the group's
    devices, P >= 2, no instance split over nodes (the engine's rule); over two nodes, D is one
    instance or a whole node of them. The pool's Eq. (1) models are fitted to the roofline and
    go into the rendered policy. Over two nodes the planner sees each instance's node, and the
    hand-off is priced on the inter-node link."""
    from gearshift.operator.sim import tetris_models

    node = hw.devices_per_node
    ptp = tetris_models.prefill_tp(model, hw, s.memory_utilization)
    if hw.count % node or ptp is None:
        return []  # no prefill instance of a node's TP holds the whole model
    fitted: dict[int, Any] = {}
    out = []
    for span in (1, 2):
        if hw.count % (span * node):
            continue
        out += _tetris_groups(model, hw, s, span, ptp, fitted)
    return out


def _tetris_groups(
    model: ModelDesc, hw: Hardware, s: PlanSettings, span: int, ptp: int, fitted: dict[int, Any]
) -> list[Candidate]:
    """The Tetris candidates of groups of ``span`` nodes with prefill instances of TP ``ptp``
    (``fitted``: Eq. (1) by SP size)."""
    # Imported here: the decode admission imports torch, which `gearshift plan` otherwise avoids.
    from gearshift.operator.planner.cdsp import PlannerRules, sp_sizes
    from gearshift.operator.sim import tetris_models
    from gearshift.operator.sim.tetris_sim import TetrisGroupSim, simulate_groups

    node = hw.devices_per_node
    size = span * node
    out = []
    for tp in range(1, node):
        if model.heads % tp or model.kv_heads % tp:
            continue
        tokens = kv_tokens(model, with_count(hw, tp), 1 / tp, tp, s)
        blocks = tokens // s.block_size
        if blocks * s.block_size < max(s.max_num_batched_tokens, s.max_model_len):
            continue
        # Over two nodes, what a second node adds is a pool larger than one node: one decode
        # instance, or a node of them (the other shapes are one-node groups' already).
        counts = range(1, size // tp + 1) if span == 1 else sorted({1, node // tp})
        for decode in counts:
            pool_ranks = size - decode * tp
            prefill = pool_ranks // ptp
            firsts = [pool_ranks + d * tp for d in range(decode)]
            if pool_ranks % ptp or prefill < 2:
                continue  # no pool of whole instances
            if any(f // node != (f + tp - 1) // node for f in firsts):
                continue  # a decode instance over two nodes
            sizes = sp_sizes(prefill, True)
            for sp in sizes:
                if sp not in fitted:
                    fitted[sp] = tetris_models.fit(model, hw, sp, ptp)
            rules = PlannerRules({sp: fitted[sp] for sp in sizes}, 1024, 4)
            link = hw.link_for("send_recv", size)  # the hand-off: KV pieces, point to point
            group = TetrisGroupSim(
                prefill,
                decode,
                rules,
                0.3,  # the planner's rate before a table; _tetris_for_traffic adds the table
                _config(blocks, s),
                RooflineCost(
                    model, with_count(hw, tp), Layout("tp", tp) if tp > 1 else Layout("one")
                ),
                model.kv_bytes_per_token(),
                link.bandwidth,
                link.latency,
                per_node=node // ptp,
                prefill_tp=ptp,
                decode_tp=tp,  # the hand-off's pieces: a decode rank's bytes a row
            )
            groups = hw.count // size
            policy = {
                "tetris": {
                    "prefillInstances": prefill,
                    "prefillTp": ptp,
                    "decodeInstances": decode,
                    "decodeTp": tp,
                    "latencyModels": [
                        {"sp": m.sp, "a": m.a, "b": m.b, "c": m.c, "d": m.d}
                        for m in (fitted[sp] for sp in sizes)
                    ],
                }
            }
            out.append(
                Candidate(
                    f"tetris{prefill}{'' if ptp == 1 else f'x{ptp}'}p{decode}x{tp}"
                    + (f"n{span}" if span > 1 else "")
                    + (f"x{groups}" if groups > 1 else ""),
                    "tetris",
                    policy,
                    size,
                    groups * decode,
                    group.decode_cost,
                    group.config,
                    tokens * decode,
                    notes={"groups": groups, "prefill_instances": prefill, "nodes": span},
                    run=functools.partial(simulate_groups, groups, group),
                    for_traffic=functools.partial(_tetris_for_traffic, group, groups),
                )
            )
    return out


def _tetris_for_traffic(
    group: Any, groups: int, candidate: Candidate, traffic: Any, rates: Sequence[float]
) -> Candidate:
    """The candidate with the request-rate → improvement-rate table (§5.1, §7.1) of its pool
    under the traffic's prompt lengths, at the per-group rates of the sweep: rendered into its
    policy and used by its simulation (the router's ``ImprovementRate`` in simulated time)."""
    import dataclasses

    from gearshift.operator.sim.tetris_rates import PoolShape, policy_rows, rate_table
    from gearshift.operator.sim.tetris_sim import simulate_groups

    per_group = sorted({r / groups for r in rates if r > 0})
    table, _ = rate_table(
        group.rules,
        PoolShape(group.prefill, group.per_node),
        traffic.prompt,
        per_group,
        requests=TETRIS_TABLE_REQUESTS,
        seed=traffic.seed,
    )
    tuned = dataclasses.replace(group, rate_table=tuple(table))
    policy = {"tetris": {**candidate.policy["tetris"], "improvementRateTable": policy_rows(table)}}
    return dataclasses.replace(
        candidate,
        policy=policy,
        run=functools.partial(simulate_groups, groups, tuned),
        for_traffic=None,
    )


TETRIS_TABLE_REQUESTS = 200  # Poisson arrivals per (request rate, improvement rate) of a table

SOURCES: dict[str, Source] = {
    "static+shift": _layout_candidates,
    "sidp": _sidp_candidates,
    "seesaw": _seesaw_candidates,
    "tetris": _tetris_candidates,
}
# The policy kinds some source simulates.
MODELLED_KINDS: tuple[str, ...] = ("static", "shift", "sidp", "seesaw", "tetris")


def enumerate_candidates(
    model: ModelDesc, hw: Hardware, settings: PlanSettings, kinds: set[str] | None = None
) -> list[Candidate]:
    """Every candidate of every registered source (only policy kinds in ``kinds`` if given)."""
    out = [c for source in SOURCES.values() for c in source(model, hw, settings)]
    return [c for c in out if kinds is None or c.kind in kinds]
