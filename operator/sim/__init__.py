"""A discrete-event simulator of one deployment under a request trace (issue 16).

Pure Python at import time (no torch): traces, the event loop, replicas that run the engine's own
``Scheduler`` and ``BlockManager`` against simulated time, and a fitted step-cost model.
"""
