"""SiDP: data-parallel replicas that share FFN weights (WaS, CaS, group-wide mode).

Torch-free on import: ``spec.py`` says the kind, ``policy.py`` runs it (kinds.py, registry.py)."""
