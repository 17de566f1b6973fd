"""What document attention costs: training tokens/s of a small Llama on packed blocks
with the block-causal mask and restarted positions (trainer.data.packing), against plain causal
attention on the same blocks, at block sizes 512 and 2048 (documents of 50-400 tokens).
Target: document attention keeps ≥ 0.9× causal's tokens/s. On CPU sdpa with any mask runs
its math kernel, and the dense mask is L² per row, so the long block pays most; on a GPU
(run where one is available) sdpa leaves the flash kernel for the memory-efficient one.

Sizes: RAYLIFT_BENCH_PACK_STEPS (timed steps per round), RAYLIFT_BENCH_REPEATS (rounds).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from tests.bench.benchutil import Check, run_benchmark, size, smoke
from trainer.data import packing

STEPS = size("RAYLIFT_BENCH_PACK_STEPS", 4, 1)
BLOCKS = (64, 128) if smoke() else (512, 2048)
MICRO = 2
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model(block: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    small = smoke()
    conf = LlamaConfig(
        vocab_size=512 if small else 4096,
        hidden_size=64 if small else 256,
        intermediate_size=128 if small else 688,
        num_hidden_layers=2 if small else 4,
        num_attention_heads=4 if small else 8,
        num_key_value_heads=2 if small else 4,
        max_position_embeddings=block,
    )
    conf._attn_implementation = "sdpa"
    return LlamaForCausalLM(conf).to(DEVICE)


def _batch(block: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(0)
    segs = np.zeros((MICRO, block), dtype=np.int64)
    for row in range(MICRO):
        pos, doc = 0, 0
        while pos < block:
            n = int(rng.integers(50, 400))
            segs[row, pos : pos + n] = doc
            pos, doc = pos + n, doc + 1
    ids = torch.from_numpy(rng.integers(3, vocab, (MICRO, block)))
    return ids.to(DEVICE), torch.from_numpy(segs).to(DEVICE)


def _command(block: int, document: bool):
    state: dict = {}

    def run(_round: int) -> dict[str, float]:
        if not state:
            model = _model(block)
            state.update(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-4))
            state["batch"] = _batch(block, model.config.vocab_size)
        model, opt = state["model"], state["opt"]
        ids, segs = state["batch"]

        def step() -> None:
            extra = packing.attention_inputs(segs, "sdpa") if document else {}
            loss = model(input_ids=ids, labels=ids, **extra).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return {"tokens_per_s": STEPS * MICRO * block / (time.perf_counter() - t0)}

    return run


def _ratio(block: int):
    return lambda r: r[f"document_{block}"]["tokens_per_s"] / r[f"causal_{block}"]["tokens_per_s"]


def test_bench_document_attention_cost():
    commands = {}
    for block in BLOCKS:
        commands[f"causal_{block}"] = _command(block, False)
        commands[f"document_{block}"] = _command(block, True)
    run_benchmark(
        "packing",
        title=f"Document attention vs causal, training tokens/s ({DEVICE.type})",
        commands=commands,
        checks=[Check(f"document_over_causal_{b}", _ratio(b), 0.9, unit="×") for b in BLOCKS],
        metric="tokens_per_s",
        unit="tokens/s",
        setup={
            "device": DEVICE.type,
            "micro_batch": MICRO,
            "blocks": list(BLOCKS),
            "mask_bytes_per_micro_batch": {
                str(b): packing.mask_bytes(MICRO, b, "sdpa") for b in BLOCKS
            },
        },
    )
