"""The metric table, its instruments and docs/metrics.md say the same: names, types, labels."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import Counter, Histogram

from gearshift.operator.router.metric_table import GROUP_METRICS, REQUEST_METRICS, MetricSpec
from gearshift.operator.router.metrics import GroupCollector, RouterMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
Row = tuple[str, str, frozenset[str]]  # exposed name, type, labels besides model_name


def _exposed(spec: MetricSpec) -> Row:
    name = spec.name + ("_total" if spec.kind == "counter" else "")
    return name, spec.kind, frozenset(spec.labels) - {"model_name"}


def _documented() -> set[Row]:
    rows: set[Row] = set()
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[1] not in ("histogram", "counter", "gauge"):
            continue
        for name, labels in re.findall(r"`(gearshift_\w+)(?:\{([^}]*)\})?`", cells[0]):
            found = frozenset(x.strip() for x in labels.split(",") if x.strip())
            rows.add((name, cells[1], found))
    return rows


def test_docs_list_every_metric_of_the_table_with_its_type_and_labels_and_no_other() -> None:
    table = {_exposed(s) for s in (*REQUEST_METRICS, *GROUP_METRICS)}
    documented = _documented()
    assert table - documented == set(), "add these to docs/metrics.md"
    assert documented - table == set(), "docs/metrics.md lists metrics the router does not export"


def test_every_row_is_one_typed_attribute_or_family_and_names_are_unique() -> None:
    annotated = {
        k: v for k, v in RouterMetrics.__annotations__.items() if v in ("Histogram", "Counter")
    }
    assert {s.key: s.kind.capitalize() for s in REQUEST_METRICS} == annotated
    metrics = RouterMetrics("m", lambda: [])
    for spec in REQUEST_METRICS:
        instrument = getattr(metrics, spec.key)
        assert isinstance(instrument, Histogram if spec.kind == "histogram" else Counter)
        assert list(instrument._labelnames) == list(spec.labels)
        if spec.buckets:
            assert list(instrument._upper_bounds[:-1]) == [float(b) for b in spec.buckets]
    families = {f.name: f for f in GroupCollector("m", lambda: []).collect()}
    assert set(families) == {s.name for s in GROUP_METRICS}
    names = [s.name for s in (*REQUEST_METRICS, *GROUP_METRICS)]
    assert len(names) == len(set(names))
    assert all(s.buckets == () for s in (*REQUEST_METRICS, *GROUP_METRICS) if s.kind != "histogram")
