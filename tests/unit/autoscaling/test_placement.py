"""Rank 0's label is a request the autoscaler can satisfy, not a preference dropped at zero."""

from __future__ import annotations

from pathlib import Path

import yaml

from trainer.autoscaling.placement import CONFIG_ENV, launchable_labels, rank0_selector

WANT = {"large_cpu_mem": "true"}


def _config(tmp_path: Path, max_workers: int) -> Path:
    path = tmp_path / "autoscaler.yaml"
    types = {
        "head": {"resources": {}, "max_workers": 0, "labels": {"large_cpu_mem": "true"}},
        "large-cpu-mem": {"labels": {"pool": "large-cpu-mem", **WANT}, "max_workers": max_workers},
        "gpu-spot": {"labels": {"pool": "gpu-spot"}, "max_workers": 4},
    }
    path.write_text(yaml.safe_dump({"available_node_types": types}))
    return path


def test_at_zero_the_label_stays_when_the_autoscaler_can_launch_it(tmp_path, monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, str(_config(tmp_path, max_workers=1)))
    assert rank0_selector(WANT, 3, live=[], launchable=launchable_labels()) == [WANT, {}, {}]


def test_a_pool_that_cannot_grow_or_a_fixed_cluster_does_not_count(tmp_path, monkeypatch):
    assert launchable_labels(_config(tmp_path, max_workers=0)) == [{"pool": "gpu-spot"}]
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert launchable_labels() == []
    assert rank0_selector(WANT, 2, live=[{"pool": "gpu-spot"}], launchable=[]) is None


def test_a_live_labelled_node_still_counts_and_no_label_means_no_selector():
    assert rank0_selector(WANT, 2, live=[WANT], launchable=[]) == [WANT, {}]
    assert rank0_selector(None, 2, live=[WANT], launchable=[WANT]) is None


def test_the_driver_asks_for_rank0s_label_on_a_cluster_at_zero(tmp_path, monkeypatch):
    """trainer.runtime.launch on a head whose pools are all at zero (only the head alive)."""
    import types

    import ray

    from trainer.runtime import launch

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Labels": {"pool": "head"}}])
    cfg = types.SimpleNamespace(scaling=types.SimpleNamespace(rank0_label=WANT, max_workers=2))
    monkeypatch.setenv(CONFIG_ENV, str(_config(tmp_path, max_workers=1)))
    assert launch._rank0_selector(cfg) == [WANT, {}]
    monkeypatch.delenv(CONFIG_ENV)
    assert launch._rank0_selector(cfg) is None  # a fixed cluster without such a node
