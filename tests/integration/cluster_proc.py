"""A LocalCluster in a process of its own (its own Ray state, apart from the session's
cluster in the test process), with nodes as the test describes them. Prints one JSON line
{"url", "token"} when ready; stops the cluster when its stdin closes.

    python -m tests.integration.cluster_proc '[{"num_cpus": 1, "env": {"K": "V"}}, ...]' \
        ['{"token": "...", "dashboard_port": 8265}']

The optional second argument brings a cluster back at the same address with the same
token (a replaced head)."""

from __future__ import annotations

import json
import sys

from tools.localcluster import LocalCluster


def main() -> None:
    nodes = json.loads(sys.argv[1])
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    cluster = LocalCluster(
        num_cpus=0,
        token=options.get("token"),
        dashboard_port=int(options.get("dashboard_port", 0)),
    )
    cluster.start()
    try:
        for node in nodes:
            cluster.add_node(
                num_cpus=node.get("num_cpus", 1), labels=node.get("labels"), env=node.get("env")
            )
        cluster.wait_nodes(1 + len(nodes))
        print(json.dumps({"url": cluster.dashboard_url, "token": cluster.token}), flush=True)
        sys.stdin.read()  # until the test closes our stdin (or dies)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
