"""One rank of the prefill → decode test: global ranks 0 and 1 are the prefill pool (TP 1 each,
whole model), 2 and 3 one decode instance of TP 2. The pool runs a chunk plan and hands the KV
over on the group's channels (``channels.open_channels``: the pool's ring channel and one per
transfer slot); the decode instance writes it into its paged cache and decodes greedily. Saves
the decode ranks' cached prompt KV and the tokens to ``<out>``.

``mode`` "stream": the layer-wise hand-off with several pieces per member. Each member's rows
are two pieces, both granted before its prefill (piece k on slot k), so one member streams two
pieces at once, on two channels; the decode ranks post every receive first, and every layer
leaves as the last chunk computes it (``LayerStream``). The first token goes after them on
slot 0."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.attention.torch_ref import TorchAttention, gather_context
from gearshift.worker.comm import CommGroup
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.loading import inspect_model, load_model
from gearshift.worker.kv.cache import KVCacheSpec, allocate_kv_cache
from gearshift.worker.p2p import P2P, start_rules
from gearshift.worker.policies.tetris.channels import open_channels
from gearshift.worker.policies.tetris.chunked_prefill import (
    PlannedChunk,
    Pool,
    last_token_member,
    rows_after,
    run_chunk_plan,
)
from gearshift.worker.policies.tetris.handoff import (
    Transfer,
    complete_piece,
    piece_label,
    post_piece,
    receive_kv,
    send_kv,
)
from gearshift.worker.policies.tetris.stream import LayerStream
from tests.worker.policies.tetris.chunk_driver import PROMPT_LENGTH, prompt

PLAN = [PlannedChunk(24, (1,)), PlannedChunk(PROMPT_LENGTH - 24, (1, 0))]
NEW_TOKENS = 6
BLOCK = 8
POOL, DECODE = (0, 1), (2, 3)


def _decode_meta(position: int, table: torch.Tensor) -> AttentionMetadata:
    slot = int(table[position // BLOCK]) * BLOCK + position % BLOCK
    return AttentionMetadata(
        num_decodes=1,
        slot_mapping=torch.tensor([slot]),
        block_tables=table[None],
        seq_lens=torch.tensor([position + 1]),
        max_decode_seq_len=position + 1,
        prefill_starts=(),
        prefill_query_lens=(),
        prefill_seq_lens=(),
    )


SLOTS = 2  # transfer slots: each member's two streamed pieces travel at once


def _pieces(rows: int) -> list[tuple[int, int]]:
    """A member's rows as two pieces (start, count), as a transfer buffer would cut them."""
    half = rows // 2
    return [(0, half), (half, rows - half)]


def _xfer(member: int, piece: int) -> int:
    """The grant number of a member's piece (the controller counts grants; here, fixed)."""
    return member * SLOTS + piece


def run_rank(
    rank: int, store_path: str, checkpoint: str, out_dir: str, mode: str = "whole"
) -> None:
    torch.set_num_threads(1)
    start_rules()  # GEARSHIFT_COMM_RULES, as a rank of a group reads it
    store = dist.FileStore(store_path, 4)
    timeout = timedelta(seconds=120)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=timeout)
    cpu = torch.device("cpu")
    decode_pg = dist.new_group(list(DECODE))
    channels = open_channels(rank, 4, [POOL], SLOTS, cpu, timeout)
    config = EngineConfig(model=checkpoint, dtype="float32")
    spec, source = inspect_model(config, cpu)
    cfg = spec.config
    ids = prompt(cfg.vocab_size)
    transfer = Transfer(rows_after(PLAN), DECODE, last_token_member(PLAN))
    if rank in POOL:
        assert channels.pool is not None
        pool = Pool(channels.pool.comm, channels.pool, TorchAttention(cfg.head_dim**-0.5))
        model = load_model(spec, source, cpu)
        if mode == "whole":
            result = run_chunk_plan(model, pool, PLAN, ids)
            first = None if result.last_logits is None else int(result.last_logits[0].argmax())
            send_kv(result.holding, first, transfer, channels.slots[0])
        else:
            pieces = _pieces(transfer.senders[rank])
            row = (cfg.num_kv_heads, cfg.head_dim, torch.float32, cpu)
            stream = LayerStream(
                pieces, DECODE, channels.slots, (0, 1), cfg.num_kv_heads, row, cfg.num_layers
            )
            # Both granted before the prefill starts: one member, two pieces in flight.
            grants = [stream.grant(k, k, _xfer(rank, k)) for k in range(len(pieces))]
            result = run_chunk_plan(model, pool, PLAN, ids, on_layer=stream.add_layer)
            assert all(g.early == cfg.num_layers for g in grants), "a layer waited"
            assert stream.finish(result.holding.positions) == [0, 1] and stream.settled
            if result.last_logits is not None:
                token = torch.tensor([int(result.last_logits[0].argmax())])
                for dst in DECODE:
                    channels.slots[0].send(token, dst, piece_label(0, "first token")).wait()
            for grant in grants:
                grant.sending.wait()
    else:
        tp = CommGroup(2, rank - 2, DECODE, decode_pg)
        model = load_model(spec, source, cpu, tp=tp)
        blocks = -(-(PROMPT_LENGTH + NEW_TOKENS) // BLOCK) + 1
        kv_spec = KVCacheSpec(
            cfg.num_layers, model.num_kv_heads, cfg.head_dim, BLOCK, torch.float32
        )
        cache = allocate_kv_cache(kv_spec, blocks, cpu)
        block_ids = list(range(blocks))[::-1][: blocks - 1]  # not the identity: the table counts
        table = torch.tensor(block_ids)
        if mode == "whole":
            # Every member's rows as one piece (grant 0 on each pair) on slot 0.
            token = receive_kv(transfer, channels.slots[0], cache, block_ids, cfg.num_kv_heads)
        else:
            posted = [
                post_piece(m, count, channels.slots[k], cache, _xfer(m, k))
                for m in POOL
                for k, (_, count) in enumerate(_pieces(transfer.senders[m]))
            ]
            first = torch.empty(1, dtype=torch.int64)
            src = transfer.token_sender
            channels.slots[0].recv(first, src, piece_label(0, "first token")).wait()
            for post in posted:
                complete_piece(post, cache, block_ids)
            token = int(first[0])
        prompt_kv = torch.stack(
            [
                torch.stack([gather_context(c, table, PROMPT_LENGTH) for c in layer])
                for layer in cache
            ]
        )  # [layers, 2, heads, L, D]
        tokens = [token]
        core = TorchAttention(cfg.head_dim**-0.5)
        with torch.no_grad():
            for step in range(NEW_TOKENS - 1):
                position = PROMPT_LENGTH + step
                hidden = model(
                    torch.tensor([tokens[-1]]),
                    torch.tensor([position]),
                    cache,
                    _decode_meta(position, table),
                    core,
                )
                logits = model.compute_logits(hidden)
                nxt = torch.tensor([int(logits[0].argmax()) if logits is not None else -1])
                dist.broadcast(nxt, src=DECODE[0], group=decode_pg)
                tokens.append(int(nxt[0]))
        torch.save({"prompt_kv": prompt_kv, "tokens": tokens}, Path(out_dir, f"decode{rank}.pt"))
    dist.barrier()
    channels.close()
    dist.destroy_process_group()


def run_dead_sender(rank: int, store_path: str, out_dir: str) -> None:
    """Rank 0 (a prefill member) dies at once; rank 1 (a decode rank) posts a streamed piece's
    receives from it afterwards, then completes the piece: the failure must surface there as
    a RuntimeError, not crash the posting."""
    import os
    import time

    start_rules()
    store = dist.FileStore(store_path, 2)
    timeout = timedelta(seconds=30)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    world = CommGroup(2, rank, (0, 1), dist.group.WORLD)
    channel = P2P(world, "transfer slot", torch.device("cpu"), timeout)  # collective: both
    if rank == 0:
        os._exit(0)
    time.sleep(1.5)
    cache = allocate_kv_cache(KVCacheSpec(2, 1, 4, 4, torch.float32), 4, torch.device("cpu"))
    posted = post_piece(0, 3, channel, cache, 0)
    try:
        complete_piece(posted, cache, [0])
        outcome = "completed"
    except RuntimeError as exc:
        outcome = f"raised: {str(exc).splitlines()[0]}"
    Path(out_dir, "dead_sender.txt").write_text(outcome)
    os._exit(0)
