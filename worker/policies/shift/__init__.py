"""The ``shift`` policy: Shift Parallelism (SP ↔ TP per step over one KV cache).

Torch-free on import: ``spec.py`` says the kind, ``policy.py`` runs it (kinds.py, registry.py)."""
