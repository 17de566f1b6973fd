"""Expandable segments on by default for GPU workers (issue 47), set where the worker
environment is made (the Ray workers' runtime_env; the torchrun process's own), never over
a user's own allocator setting, and not at all when switched off or without GPUs."""

from __future__ import annotations

import pytest

from tests.support.jobs import llama7b_job
from trainer.config import load_config
from trainer.runtime import allocator, launch


@pytest.fixture
def clean_env(monkeypatch):
    for var in allocator.USER_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_ray_workers_of_a_gpu_job_get_expandable_segments(tmp_path, clean_env):
    cfg = load_config(llama7b_job(tmp_path))
    assert cfg.scaling.use_gpu and cfg.scaling.expandable_segments
    env = launch._worker_env(cfg)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_switched_off_or_cpu_jobs_get_nothing(tmp_path, clean_env):
    off = load_config(llama7b_job(tmp_path), ["scaling.expandable_segments=false"])
    cpu = load_config(llama7b_job(tmp_path), ["scaling.use_gpu=false", "train.precision=fp32"])
    for cfg in (off, cpu):
        assert not set(allocator.USER_VARS) & set(launch._worker_env(cfg))


@pytest.mark.parametrize("var", allocator.USER_VARS)
def test_a_users_own_setting_is_passed_on_unchanged(tmp_path, clean_env, var):
    clean_env.setenv(var, "max_split_size_mb:128")
    cfg = load_config(llama7b_job(tmp_path))
    env = launch._worker_env(cfg)
    assert env[var] == "max_split_size_mb:128"
    assert [k for k in allocator.USER_VARS if k in env] == [var]


def test_torchrun_sets_it_in_its_own_process_once(tmp_path):
    cfg = load_config(llama7b_job(tmp_path))
    env: dict[str, str] = {}
    assert allocator.apply(cfg, env) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert allocator.apply(cfg, mine) == {} and mine == {
        "PYTORCH_ALLOC_CONF": "expandable_segments:False"
    }
    off = load_config(llama7b_job(tmp_path), ["scaling.expandable_segments=false"])
    none: dict[str, str] = {}
    assert allocator.apply(off, none) == {} and none == {}
