"""The Tetris group runtime (Tetris §3.2, §4): the control messages between the controller on
node 0 and the group's ranks (``messages.py``)."""
