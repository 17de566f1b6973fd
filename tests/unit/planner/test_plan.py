"""The planner, against hand-computed figures for every strategy and adapter, and the
refusal path of submit (refused before any HTTP request)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.support.jobs import LLAMA2_7B, llama7b_job
from trainer.config import load_config
from trainer.planner import memory as PM
from trainer.planner import plan as P
from trainer.planner import report as R
from trainer.planner import shape as S
from trainer.planner.memory import Setup, rank_memory
from trainer.planner.plan import plan
from trainer.planner.shape import GIB, ModelShape

ROOT = Path(__file__).resolve().parents[3]

L7 = ModelShape.from_hf_config(LLAMA2_7B)
M = 6_738_415_616
# One decoder layer's linears: q, k, v, o (4 · 4096²) + gate, up, down (3 · 4096 · 11008).
LAYER_LINEAR = 4 * 4096**2 + 3 * 4096 * 11008  # 202,375,168
LAYER = LAYER_LINEAR + 2 * 4096  # + two RMSNorm weights
EMBED = 32000 * 4096  # 131,072,000; lm_head is the same size (not tied)
ROOT_PARAMS = 2 * EMBED + 4096  # embeddings, lm_head, final norm


def test_llama2_7b_parameter_count_is_exact():
    assert EMBED + 32 * LAYER + 4096 + EMBED == M
    assert L7.params == M
    assert L7.root_params == ROOT_PARAMS


def test_gqa_tied_qwen2_count_matches_the_published_one():
    # Qwen2.5-0.5B: 494,032,768 parameters. head_dim 64, kv_dim 2·64 = 128, q/k/v biases,
    # tied embeddings (no separate lm_head).
    conf = {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
    layer = (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896
    assert layer == 14_912_384
    assert ModelShape.from_hf_config(conf).params == 151936 * 896 + 24 * layer + 896
    assert ModelShape.from_hf_config(conf).params == 494_032_768


def test_a_config_without_the_shape_says_what_to_do():
    with pytest.raises(S.UserError, match=r"hidden_size.*--params"):
        ModelShape.from_hf_config({"num_attention_heads": 4})


# ---------------------------------------------------------------- DDP


def test_7b_ddp_on_one_a10g_does_not_fit():
    s = Setup("ddp", world=1, precision="bf16", micro_batch=1, block_size=512)
    r = rank_memory(L7, s)
    # fp32 master (4 B) + autocast's bf16 copies of the matmul weights (2 B each: every
    # layer's linears and the lm_head), fp32 grads (4 B, no DDP buckets with one rank),
    # Adam's two fp32 moments (8 B): 16 B/param before the copies and activations.
    assert r.weights == 4 * M + 2 * (32 * LAYER_LINEAR + EMBED)
    assert r.gradients == 4 * M
    assert r.optimizer == 8 * M
    assert (r.gradients + r.optimizer + 4 * M) / GIB > 100  # 16·M ≈ 100.4 GiB
    p = plan(L7, s, "g5.xlarge", search=False)
    assert p.layout is not None and p.layout.verdict == "does not fit"
    assert p.refused


def test_ddp_with_more_than_one_rank_counts_the_bucket_buffers():
    one = rank_memory(L7, Setup("ddp", world=1))
    two = rank_memory(L7, Setup("ddp", world=2))
    assert two.gradients == 2 * one.gradients == 8 * M


def test_adamw8bit_keeps_two_bytes_per_param_but_deepspeed_ignores_it():
    assert rank_memory(L7, Setup("ddp", optimizer="adamw8bit")).optimizer == 2 * M
    ds = rank_memory(L7, Setup("zero2", world=4, optimizer="adamw8bit"))
    assert ds.optimizer == (4 + 8) * M / 4  # DeepSpeed builds torch AdamW (or CPU Adam)


# ---------------------------------------------------------------- FSDP2


def test_fsdp_shards_state_and_gathers_root_plus_two_layers():
    s = Setup("fsdp", world=16, precision="bf16")
    r = rank_memory(L7, s)
    # fp32 shards (4·M/16) + bf16 gathered root (embeddings, lm_head, norm) + 2 layers.
    assert r.weights == pytest.approx(4 * M / 16 + 2 * (ROOT_PARAMS + 2 * LAYER))
    # fp32 grad shards + the unsharded bf16 grads of the root and one layer.
    assert r.gradients == pytest.approx(4 * M / 16 + 2 * (ROOT_PARAMS + LAYER))
    assert r.optimizer == pytest.approx(8 * M / 16)


def test_fsdp_without_reshard_keeps_every_layer_gathered():
    r = rank_memory(L7, Setup("fsdp", world=16, fsdp_reshard=False))
    assert r.weights == pytest.approx(4 * M / 16 + 2 * (ROOT_PARAMS + M))


def test_fsdp_cpu_offload_moves_the_shards_to_host_ram():
    s = Setup("fsdp", world=8, fsdp_cpu_offload=True)
    r = rank_memory(L7, s)
    assert r.weights == pytest.approx(2 * (ROOT_PARAMS + 2 * LAYER))  # only gathered
    assert r.optimizer == 0
    host = PM.host_memory(L7, s, r)
    assert host.offload == pytest.approx((4 + 4 + 8) * M / 8)  # params, grads, Adam
    assert host.export == 4 * M  # rank 0 gathers the full fp32 state dict


# ---------------------------------------------------------------- DeepSpeed ZeRO


def test_zero2_is_2_plus_14_over_n_bytes_per_param():
    # ZeRO paper (Rajbhandari et al. 2020), mixed precision Adam: 2Ψ + (2 + 12)Ψ/N.
    s = Setup("zero2", world=8, precision="bf16")
    r = rank_memory(L7, s)
    bucket = 2 * 2 * 4096**2  # two bf16 reduce buckets of hidden² elements
    assert r.weights == 2 * M
    assert r.gradients == pytest.approx(2 * M / 8 + bucket)
    assert r.optimizer == pytest.approx(12 * M / 8)


def test_zero2_optimizer_offload_puts_16_bytes_per_param_over_n_on_the_host():
    s = Setup("zero2", world=8, offload_optimizer="cpu")
    r = rank_memory(L7, s)
    assert r.optimizer == 0
    assert PM.host_memory(L7, s, r).offload == pytest.approx(16 * M / 8)


def test_7b_zero3_offload_on_16_a10g_fits_and_needs_30_m_over_n_k_host_ram_per_node():
    s = Setup(
        "zero3",
        world=16,
        precision="bf16",
        micro_batch=8,
        block_size=512,
        checkpointing=True,
        offload_optimizer="cpu",
        offload_param="cpu",
    )
    r = rank_memory(L7, s)
    # On the GPU only the two largest modules gathered in bf16 (a layer: 202M params).
    assert r.weights == pytest.approx(2 * 2 * LAYER)
    assert r.optimizer == 0
    host = PM.host_memory(L7, s, r)
    # 2 (bf16 params) + 4 (fp32 master) + 8 (Adam) + 4 (fp32 grads) = 18 B per param / N.
    assert host.offload == pytest.approx(18 * M / 16)
    # Two g5.48xlarge (8 A10G each): K = 8 ranks per node.
    lay = P.layout(L7, s, "g5.48xlarge")
    assert lay.verdict == "fits"
    assert [(n.count, n.ranks_per_node, n.rank0) for n in lay.nodes] == [
        (1, 8, True),
        (1, 8, False),
    ]
    worker = lay.nodes[1]
    # And a checkpoint stages a copy of the fp32 master + Adam partition: 12 B / N more.
    assert host.staging == pytest.approx(12 * M / 16)
    assert worker.host_need == pytest.approx(
        S.HOST_NODE_RESERVE + 8 * (S.HOST_PER_GPU_PROCESS + 30 * M / 16)
    )
    # Rank 0's node also consolidates the 16-bit export: 2·M more.
    assert lay.nodes[0].host_need == pytest.approx(worker.host_need + 2 * M)
    assert r.total < 24 * GIB


def test_zero3_without_offload_shards_everything():
    r = rank_memory(L7, Setup("zero3", world=16, precision="bf16"))
    assert r.weights == pytest.approx(2 * M / 16 + 2 * 2 * LAYER)
    assert r.optimizer == pytest.approx(12 * M / 16)


# ---------------------------------------------------------------- adapters


def test_lora_freezes_the_base_in_the_compute_dtype():
    s = Setup("ddp", adapter="lora", precision="bf16", lora_r=8)
    r = rank_memory(L7, s)
    lora = 32 * 4 * 8 * (4096 + 4096)  # q, k, v, o: r·(in + out) each, 32 layers
    assert lora == 8_388_608 == L7.lora_params(8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert r.weights == 2 * M + 4 * lora
    assert r.gradients == 4 * lora
    assert r.optimizer == 8 * lora


def test_7b_qlora_fits_one_a10g():
    s = Setup("ddp", adapter="qlora", precision="bf16", micro_batch=1, block_size=512)
    r = rank_memory(L7, s)
    lora = 8_388_608
    quantized = 32 * LAYER_LINEAR
    # nf4 (0.5 B) + double-quantized constants (1/64 + 4/(64·256) B) on the layers' linears,
    # fp32 for embeddings, lm_head and norms, one bf16 dequantized weight (4096 × 11008).
    base = 0.515869140625 * quantized + 4 * (M - quantized) + 2 * 4096 * 11008
    assert r.weights == pytest.approx(base + 4 * lora)
    assert r.weights / GIB < 5
    p = plan(L7, s, "g5.xlarge", search=False)
    assert p.layout is not None and p.layout.verdict == "fits" and not p.refused


# ---------------------------------------------------------------- activations


TINY = ModelShape(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=512)


def test_activations_by_hand_with_and_without_checkpointing():
    s = Setup("ddp", gpu=False, precision="fp32", micro_batch=2, block_size=16)
    t = 2 * 16
    # Per token and layer (c = r = 4): c·(2h + 2q + 2kv + 4I) + 2·(4 + r)·h
    per_layer = 4 * (2 * 64 + 2 * 64 + 2 * 64 + 4 * 128) + 2 * 8 * 64  # 4608
    # Head: final norm (4 + r)·h, lm_head input r·h, logits (c + 12)·V.
    head = 8 * 64 + 4 * 64 + 16 * 512  # 8960: the logits dominate at this size
    assert PM.activation_bytes(TINY, s, False) == t * (2 * per_layer + head)
    # Checkpointing keeps each layer's input and rebuilds one layer at a time.
    assert PM.activation_bytes(TINY, s, True) == t * (2 * 4 * 64 + per_layer + head)


def test_lora_keeps_only_the_inputs_of_the_linears_it_trains():
    """Frozen linears need only their weights in backward: with adapters on q/k/v/o the
    gate/up input (h) and down's input (the gate·up product, I) are not saved; an
    adapter on down_proj keeps the product again."""
    full = Setup("ddp", gpu=False, micro_batch=2, block_size=16)
    lora = Setup("ddp", gpu=False, micro_batch=2, block_size=16, adapter="lora")
    t, layers, h, inter = 2 * 16, 2, 64, 128
    saved = PM.activation_bytes(TINY, full, False) - PM.activation_bytes(TINY, lora, False)
    assert saved == t * layers * 4 * (h + inter)
    down = Setup(
        "ddp", gpu=False, micro_batch=2, block_size=16, adapter="lora",
        lora_targets=("q_proj", "down_proj"),
    )  # fmt: skip
    assert PM.activation_bytes(TINY, full, False) - PM.activation_bytes(TINY, down, False) == (
        t * layers * 4 * h
    )


def test_total_counts_the_larger_of_gradients_and_activations_on_top_of_what_is_held():
    one = rank_memory(L7, Setup("ddp", world=1, precision="fp32", micro_batch=8))
    assert one.gradients_held == 0 and one.activations > one.gradients
    assert one.total == one.weights + one.optimizer + one.overhead + one.activations
    two = rank_memory(L7, Setup("ddp", world=2, precision="fp32", micro_batch=8))
    assert two.gradients_held == 4 * M  # the buckets stay; the .grad tensors come and go
    assert two.tensors == one.tensors + 4 * M  # device lines: tests/unit/planner/test_device.py
    ckpt = rank_memory(L7, Setup("ddp", world=1, precision="fp32", checkpointing=True))
    assert ckpt.activations < ckpt.gradients
    assert ckpt.total == ckpt.weights + ckpt.optimizer + ckpt.overhead + ckpt.gradients


def test_eager_attention_adds_the_score_matrices():
    s = Setup("ddp", gpu=False, micro_batch=1, block_size=16)
    eager = Setup("ddp", gpu=False, micro_batch=1, block_size=16, eager_attention=True)
    extra = PM.activation_bytes(TINY, eager, False) - PM.activation_bytes(TINY, s, False)
    assert extra == 16 * 2 * 4 * 16 * (4 + 4)  # tokens · layers · heads · s · (4 + c)


def test_checkpointing_is_what_makes_7b_activations_fit():
    s = Setup("fsdp", world=16, precision="bf16", micro_batch=8, block_size=512)
    r = rank_memory(L7, s)
    assert r.activations == r.activations_no_ckpt > 20 * GIB
    assert r.activations_ckpt < 4 * GIB


# ---------------------------------------------------------------- verdicts, layouts, cost


def test_verdict_margins():
    assert P.verdict(0.89, 1.0) == "fits"
    assert P.verdict(0.95, 1.0) == "tight"
    assert P.verdict(1.01, 1.0) == "does not fit"


def test_cheapest_layout_grows_the_worker_count_when_needed():
    s = Setup("zero3", world=4, precision="bf16", micro_batch=8, block_size=512, checkpointing=True)
    p = plan(L7, s)
    assert p.cheapest is not None and p.cheapest.world == 8 and p.refused
    assert p.cheapest.verdict == "fits"
    for name, inst in P.load_instances().items():
        if inst.family != "gpu":
            continue
        other = P.layout(L7, Setup(**{**S.asdict(s), "world": 8}), name)
        if other.verdict == "fits":
            assert other.usd_per_hour >= p.cheapest.usd_per_hour


def test_epoch_cost_from_a_given_and_a_derived_throughput():
    s = Setup("fsdp", world=16, precision="bf16", checkpointing=False)
    lay = P.layout(L7, s, "g5.4xlarge", tokens_per_s=4000.0)
    e = lay.epoch(3_600_000)
    assert e is not None and e["hours"] == pytest.approx(0.25)  # 3.6M / 4000 / 3600
    assert e["usd_on_demand"] == pytest.approx(0.25 * 16 * 1.624)
    assert e["usd_spot"] == pytest.approx(0.25 * 16 * 0.70)
    derived = P.layout(L7, s, "g5.4xlarge")
    # 70 TFLOP/s (A10G bf16) × 35% MFU / (6 · M FLOPs per token), per GPU, × 16 GPUs.
    assert derived.tokens_per_s == pytest.approx(16 * 70e12 * 0.35 / (6 * M))


# ---------------------------------------------------------------- config, CLI, purity


def test_setup_reads_offload_from_the_deepspeed_json(tmp_path):
    cfg = load_config(
        llama7b_job(tmp_path, strategy={"name": "deepspeed", "config": "zero3_offload"})
    )
    s = Setup.from_config(cfg)
    assert (s.strategy, s.offload_optimizer, s.offload_param) == ("zero3", "cpu", "cpu")
    assert P.plan_job(cfg).params == M


def test_trainer_plan_verb_prints_the_table_and_exits_2_when_it_will_not_fit(tmp_path, capsys):
    from trainer.__main__ import main

    assert main(["plan", str(llama7b_job(tmp_path)), "--instance", "g5.xlarge"]) == 2
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "optimizer states" in out
    rc = main(["plan", str(llama7b_job(tmp_path)), "--set", "model.adapter=qlora", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["cheapest"]["verdict"] == "fits"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_submit_refuses_a_job_that_will_not_fit_before_any_request(tmp_path, capsys):
    from tools import submit

    address = f"http://127.0.0.1:{_closed_port()}"
    job = str(llama7b_job(tmp_path))
    rc = submit.main([job, "--address", address, "--instance", "g5.xlarge", "--no-follow"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "will not fit" in err and "DOES NOT FIT" in err
    assert "cannot reach" not in err
    # --force skips the planner, so the same job now reaches for the (closed) Jobs API.
    rc = submit.main([job, "--address", address, "--instance", "g5.xlarge", "--force"])
    err = capsys.readouterr().err
    assert rc == 2 and "will not fit" not in err and "cannot reach" in err


def test_flops_per_token_for_full_training_adapters_and_recompute():
    assert P.flops_per_token(L7, Setup("ddp")) == 6 * M  # 2·M forward + 4·M backward
    assert P.flops_per_token(L7, Setup("ddp", adapter="lora")) == 4 * M  # no weight grads
    assert P.flops_per_token(L7, Setup("fsdp", checkpointing=True)) == 8 * M  # + a forward


def test_submit_skips_the_plan_when_its_inputs_are_only_on_the_cluster(tmp_path, caplog):
    import argparse

    cfg = load_config(
        llama7b_job(tmp_path, strategy={"name": "deepspeed", "config": "/efs/ds.json"})
    )
    args = argparse.Namespace(
        instance="g5.xlarge",
        rank0_instance=None,
        params=None,
        ranks_per_node=None,
        tokens_per_epoch=None,
        tokens_per_s=None,
        mfu=None,
    )
    with caplog.at_level("INFO"):
        assert R.submit_refusal(cfg, args) is None
    assert "plan: skipped" in caplog.text and "/efs/ds.json" in caplog.text
    cfg = load_config(llama7b_job(tmp_path, model={"path": str(tmp_path / "elsewhere")}))
    assert R.submit_refusal(cfg, args) is None


def test_checkpoint_staging_copy_is_counted_in_host_ram():
    """A checkpoint stages a host copy of the resume state while it is written in the
    background (trainer.storage.staging): FSDP every rank's fp32 shard and its Adam moments
    (12 B per param / N), DDP the whole state on rank 0 only, ZeRO-2/3 each rank's
    optimizer partition (fp32 master + moments, 12 B / N) and ZeRO-2's rank 0 the bf16
    module weights (2 B per param)."""
    fsdp = Setup("fsdp", world=16, precision="bf16")
    host = PM.host_memory(L7, fsdp, rank_memory(L7, fsdp))
    assert host.staging == pytest.approx(12 * M / 16) and host.staging_rank0 == 0
    lay = P.layout(L7, fsdp, "g5.12xlarge")  # 4 A10G per node
    worker = next(n for n in lay.nodes if not n.rank0)
    assert worker.host_need == pytest.approx(
        S.HOST_NODE_RESERVE + 4 * (S.HOST_PER_GPU_PROCESS + 12 * M / 16)
    )
    ddp = Setup("ddp", world=2, precision="bf16")
    host = PM.host_memory(L7, ddp, rank_memory(L7, ddp))
    assert host.staging == 0 and host.staging_rank0 == pytest.approx(12 * M)
    zero3 = Setup("zero3", world=16, precision="bf16")
    host = PM.host_memory(L7, zero3, rank_memory(L7, zero3))
    assert host.staging == pytest.approx(12 * M / 16) and host.staging_rank0 == 0
    zero2 = Setup("zero2", world=16, precision="bf16")
    host = PM.host_memory(L7, zero2, rank_memory(L7, zero2))
    assert host.staging == pytest.approx(12 * M / 16)
    assert host.staging_rank0 == pytest.approx(2 * M)


def test_ram_tier_keepers_are_counted_per_node_and_refuse_what_does_not_fit():
    """checkpoint.memory_every: each node's keeper holds up to KEEPER_COPIES snapshots of
    its ranks' shares and as many of its buddy's, plus the copies in transit; DDP's and
    the adapters' rank-0 share is counted once on every node (it or its buddy copy). A
    full 7B FSDP run on 16 A10Gs needs the bigger g5.48xlarge nodes with it."""
    copies = 2 * PM.KEEPER_COPIES + PM.SNAPSHOT_IN_TRANSIT
    fsdp = Setup("fsdp", world=16, precision="bf16", memory_tier=True)
    host = PM.host_memory(L7, fsdp, rank_memory(L7, fsdp))
    assert host.keeper == pytest.approx(copies * 12 * M / 16) and host.keeper_node == 0
    lay = P.layout(L7, fsdp, "g5.12xlarge")
    worker = next(n for n in lay.nodes if not n.rank0)
    assert worker.host_need == pytest.approx(
        S.HOST_NODE_RESERVE + 4 * (S.HOST_PER_GPU_PROCESS + 12 * M / 16 * (1 + copies))
    )
    # 16 GB of snapshots per rank: a g5.12xlarge's 192 GiB no longer holds four ranks'
    # (refused), which it does without the tier; a g5.48xlarge's 768 GiB does.
    assert lay.verdict == "does not fit"
    assert P.layout(L7, Setup("fsdp", world=16), "g5.12xlarge").verdict != "does not fit"
    assert P.layout(L7, fsdp, "g5.48xlarge").verdict != "does not fit"
    off = PM.host_memory(L7, Setup("fsdp", world=16), rank_memory(L7, Setup("fsdp", world=16)))
    assert off.keeper == 0 and off.keeper_node == 0
    lora = Setup("ddp", adapter="lora", world=2, memory_tier=True)
    host = PM.host_memory(L7, lora, rank_memory(L7, lora))
    assert host.keeper == 0 and host.keeper_node == pytest.approx(copies * host.staging_rank0)
    ddp = Setup("ddp", world=8, precision="bf16", memory_tier=True)
    need = P.layout(L7, ddp, "g5.48xlarge").nodes[0].host_need
    plain = P.layout(L7, Setup("ddp", world=8, precision="bf16"), "g5.48xlarge").nodes[0]
    host = PM.host_memory(L7, ddp, rank_memory(L7, ddp))
    assert host.keeper_node == pytest.approx(copies * 12 * M)
    assert need > plain.host_need + 0.5 * copies * 12 * M
    # The plan says what the tier costs, and says nothing of it when it is off.
    text = R.format_plan(P.plan(L7, fsdp, instance="g5.48xlarge", search=False))
    (line,) = [x for x in text.splitlines() if x.startswith("RAM tier keepers")]
    assert f"{copies * 12 * M / 16 / 2**30:.1f} GiB per rank" in line
    assert "RAM tier" not in R.format_plan(P.plan(L7, Setup("fsdp", world=16), search=False))
