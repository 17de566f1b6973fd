"""docs/checkpoints.md says what a 64-node, 3-day 7B run on g5 spot should expect: the
table is the simulator's (tools/docgen/cadencefigures.py over trainer.planner.faults_sim), so a
change to the rule, the priors or the catalog that moves a figure fails here until the
page is rewritten, as the planner's paragraph in docs/production.md is kept."""

from __future__ import annotations

from tools.docgen import cadencefigures as cf


def test_the_64_node_table_is_the_simulators() -> None:
    text = cf.PAGE.read_text()
    assert text.count(cf.BEGIN) == 1 and text.count(cf.END) == 1
    assert text == cf.page(text), "run: python -m tools.docgen.cadencefigures --write"


def test_the_table_is_labelled_and_auto_beats_the_old_defaults() -> None:
    block = cf.table()
    assert "these are simulator figures, not\nmeasurements" in block
    for row in cf.rows():
        o = row["outcomes"]
        auto, old = o["auto"], o[cf.OLD_DEFAULTS]
        assert row["scenario"].nodes == 64 and row["scenario"].days == 3
        assert auto.goodput > old.goodput and auto.usd_lost < old.usd_lost
        assert f"| {row['instance']} (" in block
