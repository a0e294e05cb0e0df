"""Every file in ``bench/results/`` is linked from a report in ``docs/benchmarks/``: a result stays
in the repository only while a report cites it (``bench/README.md``)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
REPORTS = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def test_reports_found():
    assert REPORTS, "no reports in docs/benchmarks/"


def test_every_result_is_cited_by_a_report():
    cited = {(report.parent / target).resolve() for report in REPORTS
             for target in LINK.findall(report.read_text()) if not re.match(r"[a-z]+:", target)}
    results = [p for p in RESULTS.rglob("*") if p.is_file() and p.name != ".gitignore"]
    uncited = sorted(p.relative_to(RESULTS).as_posix() for p in results if p.resolve() not in cited)
    assert not uncited, f"results no report in docs/benchmarks/ links (link them or remove them): {uncited}"
