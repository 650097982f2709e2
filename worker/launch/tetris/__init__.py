"""The Tetris group runtime (Tetris §3.2, §4): the rank processes of a prefill pool and decode
instances, and the controller on node 0 that joins them (``controller.TetrisGroup``, started by
``start.start_tetris``; served by ``server/tetris_engine.py``).

The technique's algorithms are the policy's, in ``policies/tetris/``, and so is every
point-to-point KV transfer between ranks: ring attention (``ring.py``), history rebalancing
(``rebalance.py``) and the hand-off (``handoff.py``: ``start_piece``, ``LayerStream`` on the
pool side, ``decode.ReceiveHook`` on the decode side). This package only decides when they run
(``pool_rank.py``, ``handshakes.py``) and carries control messages (``messages.py``).
"""
