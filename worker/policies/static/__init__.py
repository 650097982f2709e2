"""The ``static`` policy: one fixed layout (TP × SP × PP) for every step.

Torch-free on import: ``spec.py`` says the kind, ``policy.py`` runs it (kinds.py, registry.py)."""
