"""The router's planners: Tetris's CDSP prefill planner and decode placement (pure Python)."""
