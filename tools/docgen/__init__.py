"""The docs' generators: text in docs/ that is computed from the code, so the docs cannot
drift from it. Each module renders one page or block and checks or rewrites it
(`python -m tools.docgen.<module> --write`; with no flag it prints):

- `configref`: docs/config-reference.md, every config field (also `python tools/configref.py`);
- `planfigures`: the planner's figures quoted in docs/production.md;
- `cadencefigures`: the simulated 64-node run's table in docs/checkpoints.md;
- `block`: the marker-delimited block the figure generators share.

Each has a unit test that fails while its page is stale.
"""
