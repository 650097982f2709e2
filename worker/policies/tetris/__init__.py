"""The ``tetris`` policy: CDSP prefill over a pool of instances and TP decode instances.

Torch-free on import: ``spec.py`` says the kind, ``policy.py`` runs it (kinds.py, registry.py)."""
