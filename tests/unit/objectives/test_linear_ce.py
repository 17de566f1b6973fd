"""The chunked linear cross-entropy is the plain Hugging Face loss, to 1e-5 relative, in
its value and every gradient, and never holds a whole batch's logits: on the bare
function (ignore labels, the global divisor, bias, softcap, ragged chunks) and through
real tiny models from their configs (Llama with and without tied embeddings, document
masking, completion-only labels, a LoRA adapter with a trained lm_head copy, Gemma 2's
softcap, eval without grad, logits without labels, pp's last stage)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support import small_model
from trainer.data import packing
from trainer.objectives import linear_ce

RTOL = 1e-5


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    assert err <= RTOL, f"{what}: relative error {err:.2e}"


def plain_loss(logits: torch.Tensor, labels: torch.Tensor, num_items=None) -> torch.Tensor:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, logits.shape[-1], num_items_in_batch=num_items)


class Biggest(TorchDispatchMode):
    """The most elements of any vocab-wide tensor an op made (logits, their gradient)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a transposed weight is not a new tensor
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.shape[-1:] == (self.vocab,):
                self.most = max(self.most, t.numel())
        return out


def labels_for(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :5] = linear_ce.IGNORE  # a prompt
    labels[1, 3:9] = linear_ce.IGNORE
    return labels


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("num_items", [None, 41.0])
def test_function_matches_plain_loss_and_every_gradient(softcap, num_items):
    torch.manual_seed(0)
    batch, seq, hidden, vocab = 2, 13, 16, 50
    h = torch.randn(batch, seq, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True)
    labels = labels_for(batch, seq, vocab)
    divisor = None if num_items is None else torch.tensor(num_items)

    z = torch.nn.functional.linear(h, w, b)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    ref = plain_loss(z, labels, divisor)
    ref_grads = torch.autograd.grad(ref, [h, w, b])

    with Biggest(vocab) as seen:
        got = linear_ce.chunked_linear_cross_entropy(h, w, b, labels, divisor, softcap, chunk=5)
    got_grads = torch.autograd.grad(got * 3.0, [h, w, b])  # an outer scale (a loss scaler)

    close(got.detach(), ref.detach(), "loss")
    for name, g, r in zip(("hidden", "weight", "bias"), got_grads, ref_grads, strict=True):
        close(g, r * 3.0, name)
    assert seen.most < batch * seq * vocab  # never the whole logits


def tiny_llama(tied: bool, vocab: int = 96) -> torch.nn.Module:
    model = small_model.tiny_llama(1, vocab, tie_word_embeddings=tied, attn_implementation="sdpa")
    return model.train()


def pair(model: torch.nn.Module, chunk: int = 7) -> tuple[torch.nn.Module, torch.nn.Module]:
    mine = copy.deepcopy(model)
    assert linear_ce.install(mine, chunk=chunk)
    return model, mine


def compare(plain: torch.nn.Module, mine: torch.nn.Module, **inputs) -> None:
    """One forward/backward each; the losses and every trainable parameter's gradient."""
    ref = plain(**inputs).loss
    ref.backward()
    with Biggest(plain.config.vocab_size) as seen:
        out = mine(**inputs)
    out.loss.backward()
    assert out.logits is None
    close(out.loss.detach(), ref.detach(), "loss")
    grads = dict(plain.named_parameters())
    for name, p in mine.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            close(p.grad, grads[name].grad, name)
    tokens = inputs["input_ids"].numel()
    assert seen.most < tokens * plain.config.vocab_size, "the whole logits were made"


@pytest.mark.parametrize("tied", [False, True])
def test_llama_with_document_masking_completion_labels_and_global_divisor(tied):
    plain, mine = pair(tiny_llama(tied))
    assert (mine.lm_head.weight is mine.model.embed_tokens.weight) == tied
    batch, seq = 2, 12
    x = torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(3))
    labels = labels_for(batch, seq, 96)
    segs = torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4])
    attention = packing.attention_inputs(segs, "sdpa")
    compare(
        plain, mine, input_ids=x, labels=labels, num_items_in_batch=torch.tensor(30.0), **attention
    )


def test_lora_adapter_with_a_trained_lm_head_copy():
    from peft import LoraConfig, get_peft_model

    plain, mine = pair(tiny_llama(False))
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]
    )
    plain, mine = get_peft_model(plain, lora), get_peft_model(mine, copy.deepcopy(lora))
    mine.base_model.model.load_state_dict(plain.base_model.model.state_dict())
    x = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(4))
    compare(plain, mine, input_ids=x, labels=labels_for(2, 10, 96), num_items_in_batch=17)


def test_gemma2_softcap():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(2)
    conf = Gemma2Config(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        final_logit_softcapping=2.0,
        attn_implementation="eager",
    )
    plain, mine = pair(Gemma2ForCausalLM(conf).train())
    x = torch.randint(0, 80, (2, 10), generator=torch.Generator().manual_seed(5))
    compare(plain, mine, input_ids=x, labels=labels_for(2, 10, 80))


def test_eval_without_grad_and_logits_without_labels():
    plain, mine = pair(tiny_llama(False))
    plain.eval(), mine.eval()
    x = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(6))
    labels = labels_for(2, 10, 96)
    with torch.no_grad():
        close(mine(input_ids=x, labels=labels).loss, plain(input_ids=x, labels=labels).loss, "eval")
        assert torch.equal(mine(input_ids=x).logits, plain(input_ids=x).logits)
    assert set(mine.state_dict()) == set(plain.state_dict())


def test_the_last_pipeline_stage_makes_the_loss_from_hidden_states():
    """pp's last stage (trainer.parallel.pipeline) cut from the chunked model hands on its
    normed hidden states, and the schedule's loss made from them (last_stage_loss, the
    global divisor) is the plain stage's logits loss in value and every gradient: the
    stage's parameters and the hidden state it received. Its logits are the plain ones."""
    from trainer.parallel.pipeline import cut_to_stage, last_stage_loss, stage_logits

    plain, mine = pair(tiny_llama(False))
    for model in (plain, mine):
        cut_to_stage(model, 1, 2)
    batch, seq, vocab, hidden = 2, 12, 96, plain.config.hidden_size
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(8))
    labels, divisor = labels_for(batch, seq, vocab), torch.tensor(29.0)
    x_plain, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = last_stage_loss(plain, plain(x_plain), labels, divisor)
    ref.backward()
    with Biggest(vocab) as seen:
        out = mine(x_mine)
        got = last_stage_loss(mine, out, labels, divisor)
    got.backward()
    assert out.shape == (batch, seq, hidden)
    assert seen.most < batch * seq * vocab, "the whole logits were made"
    close(got.detach(), ref.detach(), "loss")
    close(x_mine.grad, x_plain.grad, "the stage's input")
    grads = dict(plain.named_parameters())
    for name, p in mine.named_parameters():
        close(p.grad, grads[name].grad, name)
    with torch.no_grad():
        close(last_stage_loss(mine, mine(x), labels, divisor), ref.detach(), "eval loss")
        close(stage_logits(mine, mine(x)), plain(x), "logits")


def test_an_unknown_model_keeps_the_plain_loss():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40))
    assert not linear_ce.install(model)
    assert type(model.lm_head) is torch.nn.Linear and "forward" not in vars(model)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("llama")
    tiny_llama(False).save_pretrained(out, safe_serialization=True)
    return out


def _strategy(model_dir, name: str, loss: str):
    from trainer.config import load_config
    from trainer.strategies.base import ModelSource, build_strategy

    cfg = load_config(
        {
            "model": {"path": str(model_dir)},
            "data": {"train_file": "unused.jsonl", "block_size": 12},
            "train": {"micro_batch_size": 2, "max_steps": 1, "loss": loss, "loss_chunk": 7},
            "strategy": {"name": name},
            "scaling": {"num_workers": 1},
            "run": {"name": "loss"},
        }
    )
    s = build_strategy(cfg, torch.device("cpu"), 0, 1)
    s.setup(ModelSource(model_dir, 96))
    s.model.train()
    return s


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_the_strategies_build_models_with_the_chunked_loss(saved_llama, name):
    """`train.loss: auto` puts the chunked head on the model each strategy builds (DDP
    through trainer.model.loading, FSDP2 on its meta skeleton, then fully_shard), and a
    micro step's loss and gradients equal `plain`'s."""
    import torch.distributed as dist

    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(7))
    y = labels_for(2, 12, 96)
    try:
        runs = {loss: _strategy(saved_llama, name, loss) for loss in ("plain", "auto")}
        for loss, s in runs.items():
            head = s.model.lm_head
            assert isinstance(head, linear_ce.LinearCEHead) == (loss == "auto")
            s.loss = s.train_micro(x, y, torch.tensor(19.0))
        close(runs["auto"].loss, runs["plain"].loss, "loss")
        plain = dict(runs["plain"].model.named_parameters())
        for n, p in runs["auto"].model.named_parameters():
            close(_full(p.grad), _full(plain[n].grad), n)
    finally:
        if name == "fsdp" and dist.is_initialized():
            dist.destroy_process_group()


def test_the_planner_counts_the_families_the_loss_knows():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from trainer.planner.memory import CHUNKED_FAMILIES

    named = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t] for t in CHUNKED_FAMILIES}
    assert named == set(linear_ce.CAUSAL_LMS)
