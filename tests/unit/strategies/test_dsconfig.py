"""DeepSpeed JSON configs: "auto" values filled from the job, contradictions refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.strategies.deepspeed import config as dsconfig

JOB = {
    "model": {"path": "/models/llama"},
    "data": {"train_file": "/data/train.jsonl", "block_size": 128},
    "strategy": {"name": "deepspeed", "config": "zero3"},
    "train": {"micro_batch_size": 2, "grad_accum": 4, "max_steps": 10},
    "optim": {"lr": 2e-5, "grad_clip": 0.5, "weight_decay": 0.1},
    "scaling": {"num_workers": 4},
    "run": {"name": "ds"},
}

# The Ray Llama-2 template's ZeRO-3 + CPU offload file, as users have it.
STOCK_ZERO3 = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "gather_16bit_weights_on_model_save": True,
        "round_robin_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 10,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def cfg(**over):
    return load_config(JOB, [f"{k}={v}" for k, v in over.items()])


def test_stock_zero3_json_with_auto_values_is_filled_from_the_job():
    ds = dsconfig.resolve(STOCK_ZERO3, cfg(), "zero3.json", hidden_size=64)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 2 * 4 * 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    p = ds["optimizer"]["params"]
    assert (p["lr"], p["betas"], p["eps"], p["weight_decay"]) == (2e-5, [0.9, 0.95], 1e-8, 0.1)
    z = ds["zero_optimization"]
    assert z["reduce_bucket_size"] == 64 * 64 and z["stage3_param_persistence_threshold"] == 640
    assert "auto" not in json.dumps(ds)
    assert STOCK_ZERO3["train_batch_size"] == "auto"  # the input is not modified


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (("train_micro_batch_size_per_gpu",), 8, "is 8 but the job has train.micro_batch_size"),
        (("gradient_accumulation_steps",), 1, "train.grad_accum = 4"),
        (("train_batch_size",), 64, "the global batch = 32"),
        (("gradient_clipping",), 1.0, "optim.grad_clip = 0.5"),
        (("optimizer", "params", "lr"), 1e-3, "optimizer.params.lr is 0.001 but the job has"),
        (("bf16", "enabled"), True, "bf16.enabled is True"),
    ],
)
def test_a_contradicting_value_is_an_error_naming_both(path, value, needle):
    ds = json.loads(json.dumps(STOCK_ZERO3))
    node = ds
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError, match=r"zero3\.json: ") as exc:
        dsconfig.resolve(ds, cfg(), "zero3.json")
    assert needle in str(exc.value)


def test_an_agreeing_value_is_fine_and_a_scheduler_block_is_refused():
    ds = json.loads(json.dumps(STOCK_ZERO3))
    ds["train_micro_batch_size_per_gpu"] = 2
    ds["optimizer"]["params"]["lr"] = 2e-5
    assert dsconfig.resolve(ds, cfg(), "x.json")["train_micro_batch_size_per_gpu"] == 2
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}
    with pytest.raises(ConfigError, match="remove the scheduler block"):
        dsconfig.resolve(ds, cfg(), "x.json")


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_offload"])
def test_shipped_configs_resolve(name):
    raw, where = dsconfig.load(name)
    ds = dsconfig.resolve(raw, cfg(**{"strategy.config": name}), where, hidden_size=32)
    assert dsconfig.stage(ds) == (2 if name == "zero2" else 3)
    assert "auto" not in json.dumps(ds)


def test_unknown_shipped_name():
    with pytest.raises(ConfigError, match="'zero9' is not a shipped config"):
        dsconfig.load("zero9")


# ------------------------------------------------------------------ the Ray template's files

TEMPLATE = Path(__file__).resolve().parents[2] / "data" / "ray_template"


def _template(name: str) -> tuple[dict, str]:
    return dsconfig.load(str(TEMPLATE / name))


def test_template_7b_file_resolves_and_gets_deepspeeds_cpu_adam():
    raw, where = _template("zero_3_llama_2_7b.json")
    assert "optimizer" not in raw
    ds = dsconfig.resolve(raw, cfg(), where, hidden_size=64)
    dsconfig.check(ds, where)
    assert "auto" not in json.dumps(ds)
    assert dsconfig.client_optimizer(ds) == "cpu_adam"
    assert dsconfig.nvme_paths(ds) == {}
    assert "zero_force_ds_cpu_optimizer" not in ds  # DeepSpeed's own check stays on


def test_template_70b_file_names_its_nvme_folder():
    raw, where = _template("zero_3_llama_2_70b.json")
    ds = dsconfig.resolve(raw, cfg(), where, hidden_size=64)
    dsconfig.check(ds, where)
    assert dsconfig.client_optimizer(ds) == "cpu_adam"
    assert dsconfig.nvme_paths(ds) == {
        "zero_optimization.offload_optimizer.nvme_path": "/mnt/local_storage/zero"
    }


@pytest.mark.parametrize(("name", "want"), [("zero2", "adamw"), ("zero3", "adamw")])
def test_shipped_files_without_offload_get_torch_adamw(name, want):
    raw, where = dsconfig.load(name)
    assert dsconfig.client_optimizer(dsconfig.resolve(raw, cfg(), where, hidden_size=8)) == want
    raw, where = dsconfig.load("zero3_offload")  # names its optimizer: DeepSpeed builds it
    assert dsconfig.client_optimizer(raw) is None


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda z: z.update(sub_group_size="auto"),
            'x.json: zero_optimization.sub_group_size is "auto" but the job has nothing',
        ),
        (
            lambda z: z["offload_optimizer"].update(device="gpu"),
            "x.json: zero_optimization.offload_optimizer.device is 'gpu'; use one of none, cpu",
        ),
        (
            lambda z: z.update(stage=2),
            "x.json: zero_optimization.offload_param needs stage 3 (this file has stage 2)",
        ),
        (
            lambda z: z["offload_param"].update(device="nvme"),
            "x.json: zero_optimization.offload_param.nvme_path is not set but the device is nvme",
        ),
    ],
)
def test_what_cannot_run_is_refused_in_one_line_naming_the_key(edit, needle):
    raw, _ = _template("zero_3_llama_2_7b.json")
    edit(raw["zero_optimization"])
    ds = dsconfig.resolve(raw, cfg(), "x.json", hidden_size=64)
    with pytest.raises(ConfigError) as exc:
        dsconfig.check(ds, "x.json")
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_preflight_builds_the_final_config_from_the_models_hidden_size(job, tiny):
    from trainer.preflight import run_all

    hidden = json.loads((tiny["model"] / "config.json").read_text())["hidden_size"]
    source = TEMPLATE / "zero_3_llama_2_7b.json"
    report = run_all(load_config(job(), ["strategy.name=deepspeed", f"strategy.config={source}"]))
    assert report.deepspeed is not None
    zero = report.deepspeed["zero_optimization"]
    assert zero["reduce_bucket_size"] == hidden * hidden
    assert zero["stage3_param_persistence_threshold"] == 10 * hidden


def test_zero3_placeholder_parameters_are_grouped_by_their_full_shape():
    """Under ZeRO-3 every parameter is an empty 1-D placeholder on each rank; weight decay
    must still go to the matrices (DeepSpeed records the full shape as `ds_shape`)."""
    import torch

    from trainer.strategies.base import param_groups

    model = torch.nn.Linear(4, 3)
    for p in model.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    decay, no_decay = param_groups(model, 0.1)
    assert [p.ds_shape for p in decay["params"]] == [torch.Size([3, 4])]
    assert [p.ds_shape for p in no_decay["params"]] == [torch.Size([3])]


def test_nvme_offload_on_cpu_workers_is_refused_once_deepspeed_would_swap(job, tiny, tmp_path):
    """DeepSpeed 0.19.8's CPU NVMe swap hangs (aio.overlap_events true, the template's
    value) or turns the loss NaN at its first swapped step (false; the same run with
    device cpu trains): seen in the CPU image with a 0.5M-parameter Llama. A state under
    its smallest swap (1 MiB a tensor) never reaches it and runs; GPUs are not refused."""
    from trainer.preflight import run_all

    source = TEMPLATE / "zero_3_llama_2_70b.json"
    args = ["strategy.name=deepspeed", f"strategy.config={source}"]
    small = run_all(load_config(job(), args), strict=False)  # the tiny Llama: 0.56 MB a tensor
    assert small.params is not None and 4 * small.params < 2**20
    big = tmp_path / "big"
    big.mkdir()
    conf = json.loads((tiny["model"] / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**conf, "hidden_size": 256}))
    with pytest.raises(ConfigError) as exc:
        run_all(
            load_config(job(), [*args, f"model.path={big}", f"model.tokenizer={tiny['model']}"]),
            strict=False,
        )
    msg = str(exc.value)
    assert "\n" not in msg and "offload_optimizer.device nvme on CPU workers" in msg
    assert "set the offload device to cpu" in msg
