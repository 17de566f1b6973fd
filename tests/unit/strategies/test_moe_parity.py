"""Mixture-of-experts models match one process under every strategy that holds them.

A tiny Qwen3-MoE and a tiny Mixtral (4 experts, 2 per token, built from their configs)
run one micro batch per rank on 2 spawned gloo ranks (no Ray) under DDP, FSDP2 and ZeRO-3
(DS_ACCELERATOR=cpu), each in full and with LoRA on the routed experts. One process runs
the same two micro batches as gradient accumulation. The language-model loss plus the
router's aux loss of each rank, the step's aux loss (reduced over ranks) and every
gradient must agree within 1e-5. FSDP2 must shard whole decoder layers: a rank that routed
no token to an expert still gathers it with its layer, so no rank waits on an expert
alone (pytorch #126616). The module stays light: spawn imports it in each rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

VOCAB = 64
KINDS = ("qwen3_moe", "mixtral")
# ZeRO-3 last: its partitioned init leaves torch's F.linear patched in the process.
STRATEGIES = ("ddp", "fsdp", "zero3")
ADAPTERS = ("none", "lora")
WORLD = 2
TOL = 1e-5


def _cfg(model_dir: str, strategy: str, adapter: str):
    from trainer.config import load_config

    section = (
        {"name": "deepspeed", "config": "zero3"} if strategy == "zero3" else {"name": strategy}
    )
    return load_config(
        {
            "model": {"path": model_dir, "adapter": adapter, "lora": {"r": 4, "alpha": 8}},
            "data": {"train_file": "unused.jsonl", "block_size": 12},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "strategy": section,
            "scaling": {"num_workers": WORLD},
            "run": {"name": "moe-parity"},
        }
    )


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro batch: a different prompt length on each, so the ranks hold
    different numbers of targets and the aux loss's target weighting matters."""
    gen = torch.Generator().manual_seed(30 + rank)
    x = torch.randint(0, VOCAB, (2, 12), generator=gen)
    y = x.clone()
    y[:, : 1 + 4 * rank] = -100
    return x, y


def _divisor() -> float:
    """The loop's loss divisor: the step's targets over the world (trainer.loop)."""
    total = sum(int((_batch(r)[1][:, 1:] != -100).sum()) for r in range(WORLD))
    return total / WORLD


def _clean(name: str) -> str:
    """A parameter's name without the strategies' wrappers (DDP's and DeepSpeed's
    `module.`, activation checkpointing's)."""
    name = name.removeprefix("module.")
    return name.replace("_checkpoint_wrapped_module.", "")


def _grads(strategy, name: str) -> dict[str, list]:
    module = getattr(strategy.model, "module", strategy.model)
    out = {}
    for n, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if name == "zero3":
            from deepspeed.utils import safe_get_full_grad

            g = safe_get_full_grad(p)
        else:
            g = p.grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
        out[_clean(n)] = torch.zeros(p.shape).tolist() if g is None else g.detach().tolist()
    return out


def _fsdp_units(model: torch.nn.Module) -> dict[str, list[str]]:
    """Which modules FSDP2 made units of: the decoder layers, and none inside them."""
    from torch.distributed.fsdp import FSDPModule

    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    layers = [n for n in units if n.rsplit(".", 1)[-1].isdigit()]
    inner = [n for n in units if any(n.startswith(f"{lay}.") for lay in layers)]
    return {"layers": layers, "inner": inner}


def _ranks(rank: int, store: str, root: str, out: str) -> None:
    import gc

    import torch.distributed as dist

    from trainer.strategies.base import ModelSource, build_strategy

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD)
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)

    def all_reduce(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    got: dict[str, object] = {}
    for name in STRATEGIES:
        for kind in KINDS:
            for adapter in ADAPTERS:
                model_dir = f"{root}/{kind}"
                s = build_strategy(_cfg(model_dir, name, adapter), torch.device("cpu"), rank, WORLD)
                s.setup(ModelSource(Path(model_dir), VOCAB))
                s.model.train()
                x, y = _batch(rank)
                with s.accumulating(True):
                    loss = float(s.train_micro(x, y, torch.tensor(_divisor())))
                key = f"{name}/{kind}/{adapter}"
                got[key] = {
                    "loss": loss,
                    "aux": s.objective.metrics(all_reduce).get("aux_loss"),
                    "grads": _grads(s, name),
                }
                if name == "fsdp":
                    got[key]["units"] = _fsdp_units(s.model)
                dist.barrier()
                del s
                gc.collect()
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()


def _one_process(model_dir: Path, kind: str, adapter: str) -> dict[str, object]:
    """The reference: one process, the ranks' micro batches accumulated into one step."""
    from transformers import AutoModelForCausalLM

    from trainer.model import adapters
    from trainer.objectives.sft import SFT

    cfg = _cfg(str(model_dir), "ddp", adapter)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter != "none":
        model = adapters.apply(model, cfg, grew_vocab=False)
    model.train()
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sft = SFT(cfg)
    losses = []
    for rank in range(WORLD):
        x, y = _batch(rank)
        loss = sft.loss(model, x, y, torch.tensor(_divisor()))
        (loss / WORLD).backward()  # the strategies average the ranks' gradients
        losses.append(float(loss))
    grads = {
        n: (torch.zeros(p.shape) if p.grad is None else p.grad)
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return {"losses": losses, "aux": sft.metrics(lambda v: v)["aux_loss"], "grads": grads}


def test_moe_under_ddp_fsdp2_and_zero3_matches_one_process(tmp_path):
    from safetensors import safe_open

    from tests.unit.model.test_moe_lora import tiny_moe

    for kind in KINDS:
        tiny_moe(kind).save_pretrained(str(tmp_path / kind))
    (f,) = (tmp_path / "qwen3_moe").glob("*.safetensors")
    with safe_open(str(f), framework="pt") as st:  # per-expert Linears: FSDP2 converts them
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in set(st.keys())
    out = tmp_path / "got.json"
    outs = [str(out), *(f"{out}.{r}" for r in range(1, WORLD))]
    mp.start_processes(
        _ranks,
        args=(str(tmp_path / "store"), str(tmp_path), outs[0]),
        nprocs=WORLD,
        start_method="spawn",
        join=True,
    )
    got = json.loads(out.read_text())
    for kind in KINDS:
        for adapter in ADAPTERS:
            want = _one_process(tmp_path / kind, kind, adapter)
            assert want["aux"] > 0.5  # on, and not a zero (~1 for a balanced router)
            for name in STRATEGIES:
                case = got[f"{name}/{kind}/{adapter}"]
                where = (name, kind, adapter)
                # Rank 0's own micro-batch loss (rank 1's is checked through the gradients).
                assert abs(case["loss"] - want["losses"][0]) < TOL, (where, case["loss"], want)
                assert abs(case["aux"] - want["aux"]) < TOL, (where, case["aux"], want["aux"])
                grads = case["grads"]
                assert sorted(grads) == sorted(want["grads"]), where
                experts = 0
                for n, g in want["grads"].items():
                    diff = float((torch.tensor(grads[n]) - g).abs().max())
                    assert diff < TOL, (where, n, diff)
                    experts += ".experts." in n and float(g.abs().sum()) > 0
                assert experts >= 4, (where, experts)  # both layers' experts train
    for kind in KINDS:
        for adapter in ADAPTERS:
            units = got[f"fsdp/{kind}/{adapter}"]["units"]
            assert len(units["layers"]) == 2, units  # each decoder layer one unit
            assert units["inner"] == [], units  # no expert (nor anything) its own unit
