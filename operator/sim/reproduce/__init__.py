"""The four papers' headlines reproduced with the simulator from their published inputs
(issue 16, "Fidelity against the papers"; docs/planning.md has the table)."""
