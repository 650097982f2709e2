"""The ``seesaw`` policy: Seesaw's PP prefill ↔ TP decode re-sharding over a host KV tier.

Torch-free on import: ``spec.py`` says the kind, ``policy.py`` runs it (kinds.py, registry.py)."""
