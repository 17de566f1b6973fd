"""`submit.py doctor`: submit `python -m trainer doctor`, then judge and show its answer.

The job reports each node's facts (trainer.runtime.doctor); this side decides what is red, since
only here are all nodes seen together: a version that differs across nodes is red on
every node, whichever one is "right". Token auth is also probed from here, the way an
attacker would: a request to the Jobs API without the token must be refused.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import Counter
from typing import Any

from trainer.observability.logs import find_marked
from trainer.runtime.doctor import MARK

VERSIONED = ("python", "ray", "torch", "transformers")


def parse(logs: str) -> dict[str, Any] | None:
    for line in reversed(logs.splitlines()):
        found, _ = find_marked(line, MARK)
        if found is not None:
            return found
    return None


def judge(result: dict[str, Any]) -> dict[str, Any]:
    """Mark versions that are not the same on every node as failed (in place)."""
    nodes = result["nodes"]
    for key in VERSIONED:
        values = Counter(n["checks"][key]["value"] for n in nodes if key in n["checks"])
        if len(values) > 1:
            for n in nodes:
                row = n["checks"].get(key)
                if row is not None:
                    others = sorted(v for v in values if v != row["value"])
                    row["ok"] = False
                    row["detail"] = f"differs across nodes (also {', '.join(others)})"
    return result


def failures(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(node, check) for every red row; node "cluster" for cluster-wide rows."""
    out = [
        (n["node_id"], name)
        for n in result["nodes"]
        for name, row in n["checks"].items()
        if not row["ok"]
    ]
    for name, row in result.get("cluster", {}).items():
        if not row["ok"]:
            out.append(("cluster", name))
    return out


def probe_auth(address: str) -> dict[str, Any]:
    """Without a token the Jobs API must say 401/403; a 200 means anyone can run code."""
    req = urllib.request.Request(address.rstrip("/") + "/api/jobs/")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            code = r.status
    except urllib.error.HTTPError as exc:
        code = exc.code
    except OSError as exc:
        return {"value": f"could not probe: {exc}", "ok": False}
    if code in (401, 403):
        return {"value": f"token required (a request without it got {code})", "ok": True}
    return {"value": f"OPEN: a request without a token got {code}", "ok": False}


def render(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    for n in result["nodes"]:
        role = "head" if n.get("head") else "worker"
        labels = ",".join(
            f"{k}={v}"
            for k, v in sorted(n.get("labels", {}).items())
            if not k.startswith("ray.io/")  # Ray's own (node id, market type, …)
        )
        title = f"node {n['node_id'][:12]} ({role}, {n.get('ip', '?')}) {labels}".rstrip()
        table = Table(title=title, title_justify="left")
        table.add_column("check")
        table.add_column("value")
        table.add_column("")
        for name, row in n["checks"].items():
            value = row["value"] + (f" — {row['detail']}" if row.get("detail") else "")
            mark = "ok" if row["ok"] else "FAIL"
            table.add_row(name, value, mark, style=None if row["ok"] else "bold red")
        console.print(table)
    table = Table(title="cluster", title_justify="left")
    table.add_column("check")
    table.add_column("value")
    table.add_column("")
    for name, row in result.get("cluster", {}).items():
        mark = "ok" if row["ok"] else "FAIL"
        table.add_row(name, row["value"], mark, style=None if row["ok"] else "bold red")
    console.print(table)
