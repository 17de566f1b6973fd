"""Will it fit, where, and at what cost: model shape, memory per rank and node, layouts,
throughput and the instance catalog. Pure Python: it runs on a laptop."""
