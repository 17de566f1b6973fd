"""Config validation: each class of bad input is one clear error naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.config import JobConfig, load_config
from trainer.errors import ConfigError

GOOD = {
    "model": {"path": "/models/llama"},
    "data": {"train_file": "/data/train.jsonl", "block_size": 128},
    "train": {"micro_batch_size": 2, "max_steps": 10},
    "scaling": {"num_workers": 4},
    "run": {"name": "ok-run"},
}


def write(tmp_path: Path, data: dict | str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return p


def error_of(tmp_path: Path, data: dict | str, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, data), overrides)
    return str(exc.value)


def test_good_config_has_derived_values(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.global_batch == 2 * 1 * 4
    assert cfg.tokens_per_step == 8 * 128
    assert cfg.backend == "gloo"
    assert cfg.checkpoint.keep_last == 3


def test_unknown_key_names_field_and_line(tmp_path):
    text = yaml.safe_dump(GOOD, sort_keys=False).replace(
        "max_steps: 10", "max_steps: 10\n  lerning_rate: 1"
    )
    msg = error_of(tmp_path, text)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "lerning_rate" in s)
    assert f"job.yaml:{line}: train.lerning_rate: unknown key" in msg


def test_wrong_type_shows_value(tmp_path):
    msg = error_of(tmp_path, GOOD, ["train.micro_batch_size=two"])
    assert "train.micro_batch_size" in msg and "'two'" in msg


def test_missing_required_section(tmp_path):
    data = {k: v for k, v in GOOD.items() if k != "run"}
    assert "run: required field is missing" in error_of(tmp_path, data)


def test_global_batch_must_divide(tmp_path):
    msg = error_of(tmp_path, GOOD, ["train.global_batch_size=20"])
    assert "train.global_batch_size: 20 is not divisible by" in msg and "= 8" in msg


def test_global_batch_derives_grad_accum(tmp_path):
    cfg = load_config(write(tmp_path, GOOD), ["train.global_batch_size=32"])
    assert cfg.train.grad_accum == 4 and cfg.global_batch == 32


def test_contradicting_grad_accum(tmp_path):
    msg = error_of(tmp_path, GOOD, ["train.global_batch_size=32", "train.grad_accum=3"])
    assert "train.grad_accum: 3 contradicts" in msg


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.precision=bf16"], "train.precision: bf16 needs GPUs"),
        (["scaling.backend=nccl"], "scaling.backend: nccl needs"),
        (["model.attn_implementation=flash_attention_2"], "should be 'auto', 'sdpa' or 'eager'"),
        (["strategy.name=zero9"], "strategy.name: 'zero9' is not available"),
        (["train.strategy=fsdp"], "train.strategy moved to its own section"),
        (
            ["strategy.name=fsdp", "strategy.tp=2", "model.adapter=lora"],
            "model.adapter: lora with strategy.tp/pp > 1 is not supported in this build",
        ),
        (
            ["strategy.name=deepspeed", "model.adapter=qlora"],
            "model.adapter: qlora is not supported with strategy deepspeed",
        ),
        (
            ["strategy.name=deepspeed", "train.compile=true"],
            "train.compile: not supported with strategy deepspeed in this build",
        ),
        (
            ["strategy.name=deepspeed", "optim.name=adamw8bit"],
            "optim.name: adamw8bit is not available with strategy deepspeed",
        ),
        (["strategy.name=ddp", "strategy.cpu_offload=true"], "strategy.cpu_offload"),
        (["strategy.name=fsdp", "strategy.cpu_offload=true"], "cpu_offload: needs GPUs"),
        (["model.lora.r=0"], "model.lora.r"),
        (["run.name=has space"], "run.name: 'has space'"),
        (["train.stop_at_step=11"], "stop_at_step: 11 is past max_steps 10"),
        (["optim.warmup_steps=10"], "optim.warmup_steps: 10 leaves no steps"),
        (["storage.endpoint_override=http://127.0.0.1:9"], "endpoint_override is only"),
        (["optim.lr=-1"], "optim.lr"),
        (["data.block_size=1"], "data.block_size"),
        (["data.train_file=s3://b/corpus/"], "data.cache_dir: required for s3:// data"),
        (["data.loss_on=prompt"], "data.loss_on"),
    ],
)
def test_impossible_combinations(tmp_path, overrides, needle):
    assert needle in error_of(tmp_path, GOOD, overrides)


def test_yaml_syntax_error_has_line(tmp_path):
    msg = error_of(tmp_path, "model:\n  path: [unclosed\nrun:\n  name: x\n")
    assert msg.startswith(str(tmp_path / "job.yaml") + ":") and "not valid YAML" in msg


def test_override_creates_and_parses_values(tmp_path):
    cfg = load_config(
        write(tmp_path, GOOD), ["optim.lr=1e-4", "checkpoint.every_steps=5", "optim.grad_clip=null"]
    )
    assert cfg.optim.lr == pytest.approx(1e-4)
    assert cfg.checkpoint.every_steps == 5
    assert cfg.optim.grad_clip is None


def test_bad_override_syntax(tmp_path):
    assert "expected section.field=value" in error_of(tmp_path, GOOD, ["lr=1"])


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/job.yaml")


def test_round_trip_yaml(tmp_path):
    cfg = load_config(write(tmp_path, GOOD), ["train.global_batch_size=16"])
    again = load_config(write(tmp_path, cfg.to_yaml()))
    assert again == cfg


def test_strategy_sections_are_typed(tmp_path):
    over = ["strategy.name=fsdp", "strategy.cpu_offload=true", "scaling.use_gpu=true"]
    cfg = load_config(write(tmp_path, GOOD), over)
    assert cfg.strategy.name == "fsdp" and cfg.strategy.cpu_offload is True
    assert load_config(write(tmp_path, GOOD)).strategy.name == "ddp"
    cfg = load_config(write(tmp_path, GOOD), ["model.adapter=qlora", "optim.name=adamw8bit"])
    assert cfg.model.adapter == "qlora" and cfg.model.lora.target_modules == "auto"
    again = load_config(write(tmp_path, cfg.to_yaml()))
    assert again == cfg


def test_s3_data_takes_the_storage_endpoint(tmp_path):
    cfg = load_config(
        write(tmp_path, GOOD),
        [
            "data.train_file=s3://b/corpus/*.jsonl.gz",
            "data.cache_dir=/mnt/efs/cache",
            "storage.endpoint_override=http://127.0.0.1:9",
        ],
    )
    assert cfg.data.loss_on == "completion" and cfg.data.long_rows == "split"


@pytest.mark.parametrize(
    ("schedule", "hf_name", "extra"),
    [
        ("cosine", "cosine_with_min_lr", {"scheduler_specific_kwargs": {"min_lr_rate": 0.1}}),
        ("linear", "linear", {}),
        ("constant", "constant_with_warmup", {}),
    ],
)
@pytest.mark.parametrize(("steps", "warmup"), [(40, 5), (3, 10), (1, 0)])
def test_lr_schedule_matches_hugging_faces_step_by_step(schedule, hf_name, extra, steps, warmup):
    """Our schedules (plain torch LambdaLR) give the learning rates Hugging Face's
    get_scheduler gives, at every step, a warmup longer than the run included."""
    import torch
    from transformers import get_scheduler

    from trainer.loop import build_scheduler

    cfg = JobConfig.model_validate(
        {
            "model": {"path": "m"},
            "data": {"train_file": "t.jsonl"},
            "optim": {
                "lr": 2e-3,
                "schedule": schedule,
                "warmup_steps": warmup,
                "min_lr_ratio": 0.1,
            },
            "run": {"name": "lr"},
        }
    )

    def lrs(make) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
        sched = make(opt)
        out = []
        for _ in range(steps + 1):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    ours = lrs(lambda opt: build_scheduler(cfg, opt, steps))
    w = min(warmup, max(steps - 1, 0))
    if hf_name == "constant_with_warmup":
        theirs = lrs(lambda opt: get_scheduler(hf_name, opt, num_warmup_steps=w))
    else:
        theirs = lrs(
            lambda opt: get_scheduler(
                hf_name, opt, num_warmup_steps=w, num_training_steps=steps, **extra
            )
        )
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert ours[0] == (0.0 if w else cfg.optim.lr)


def test_compile_without_a_c_compiler_is_refused_before_any_worker_starts(monkeypatch, tmp_path):
    """torch.compile builds kernels with the node's C compiler: without one, the driver
    refuses the job in one line (it would fail at step 1, after loading and sharding)."""
    from trainer import preflight
    from trainer.config import load_config
    from trainer.errors import UserError

    path = tmp_path / "job.yaml"
    path.write_text("model: {path: m}\ndata: {train_file: t.jsonl}\nrun: {name: c}\n")
    cfg = load_config(path, ["train.compile=true"])
    preflight.check_compiler(cfg)  # this machine has one
    monkeypatch.setenv("PATH", str(tmp_path))  # and now none
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(UserError) as err:
        preflight.check_compiler(cfg)
    assert str(err.value).startswith("train.compile: no C compiler on this node")
    preflight.check_compiler(load_config(path, []))  # compile off: nothing needed
