"""The planner's logits term follows train.loss: with the chunked loss a micro batch's
fp32 logits and their gradient are one chunk's, not the whole batch's (issue 47)."""

from __future__ import annotations

from dataclasses import replace

from trainer.config import load_config
from trainer.planner.memory import Setup, activation_bytes, chunked_loss, logits_bytes
from trainer.planner.shape import ModelShape

LLAMA3_8B = ModelShape(4096, 32, 32, 8, 14336, 128256, model_type="llama")
TOKENS = 8 * 512


def setup(**kw) -> Setup:
    return Setup("fsdp", world=8, micro_batch=8, block_size=512, checkpointing=True, **kw)


def test_the_chunked_loss_drops_the_whole_logits_from_the_activations():
    plain = activation_bytes(LLAMA3_8B, setup(loss="plain"), True)
    chunked = activation_bytes(LLAMA3_8B, setup(loss="auto"), True)
    v, h = LLAMA3_8B.vocab, LLAMA3_8B.hidden
    # What the plain loss holds per token and vocab entry (bf16 lm_head output, fp32
    # upcast, both fp32 gradients) is gone, but for one chunk of 1024 tokens (one fp32
    # buffer, the bf16 matmul output / gradient cast); the gradient wrt the hidden states
    # and lm_head's fp32 weight gradient are held instead.
    whole = TOKENS * v * (2 + 12)
    held = 1024 * v * (4 + 2) + TOKENS * h * 2 + 4 * v * h
    assert plain - chunked == whole - held
    assert plain - chunked > 2 * TOKENS * v * 4 * 0.45  # about the fp32 logits and grad
    assert logits_bytes(LLAMA3_8B, setup(loss="auto", loss_chunk=256), TOKENS) < held


def test_which_loss_the_planner_counts():
    assert chunked_loss(LLAMA3_8B, setup(loss="auto"))
    assert not chunked_loss(LLAMA3_8B, setup(loss="plain"))
    assert chunked_loss(LLAMA3_8B, setup(loss="auto", pp=2))  # pp's last stage
    assert chunked_loss(LLAMA3_8B, setup(loss="auto", tp=2))  # lm_head replicated
    assert not chunked_loss(LLAMA3_8B, setup(loss="plain", pp=2, tp=2))
    other = replace(LLAMA3_8B, model_type="gpt_neox")
    assert not chunked_loss(other, setup(loss="auto")) and chunked_loss(
        other, setup(loss="chunked")
    )
    gemma = replace(LLAMA3_8B, model_type="gemma2", logit_softcap=30.0)
    softcap = logits_bytes(gemma, setup(loss="auto"), TOKENS) - logits_bytes(
        LLAMA3_8B, setup(loss="auto"), TOKENS
    )
    assert softcap == 1024 * LLAMA3_8B.vocab * 4  # tanh's value, one chunk


def test_the_job_config_reaches_the_planner():
    def job(**train) -> Setup:
        return Setup.from_config(
            load_config(
                {
                    "model": {"path": "/m"},
                    "data": {"train_file": "t.jsonl"},
                    "train": {"max_steps": 1, **train},
                    "checkpoint": {"memory_every": 0},
                    "run": {"name": "x"},
                }
            )
        )

    assert (job().loss, job().loss_chunk) == ("auto", 1024)
    assert (job(loss="plain", loss_chunk=64).loss, job(loss_chunk=64).loss_chunk) == ("plain", 64)


def test_liger_counts_its_own_chunk():
    """train.loss liger: liger-kernel 0.8.5's chunk is the tokens over ceil(vocab / h),
    up to a power of two (128 at Llama-3-8B's shape and 8 × 512 tokens), one bf16 logits
    buffer each; the kept gradients are the chunked version's. auto counts the chunked
    version's larger buffers (liger may not import on the worker)."""
    v, h = LLAMA3_8B.vocab, LLAMA3_8B.hidden
    assert chunked_loss(LLAMA3_8B, setup(loss="liger"))
    kept = TOKENS * h * 2 + 4 * v * h
    assert logits_bytes(LLAMA3_8B, setup(loss="liger"), TOKENS) == 128 * v * 2 + kept
    assert logits_bytes(LLAMA3_8B, setup(loss="auto"), TOKENS) == 1024 * v * 6 + kept
    small = replace(LLAMA3_8B, vocab=4000)  # one chunk of every token: ceil(4000/4096) = 1
    assert logits_bytes(small, setup(loss="liger"), 100) == 100 * 4000 * 2 + (
        100 * h * 2 + 4 * 4000 * h
    )
