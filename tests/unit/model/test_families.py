"""Each model family the trainer is checked on (docs/models.md), in-process on tiny random
models built from each family's own transformers config: the attention it gets, the
adapters it gets, a training step with each, the export loaded by the docs' recipe, the
planner's reading of its config.json, and document attention exact against each
document run alone. The table in trainer.model.families is held against transformers'
and peft's own flags here, so it cannot drift from the pinned versions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import transformers
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tests.support.families import FAMILIES, WINDOW, build_family
from trainer.config import load_config
from trainer.data import packing
from trainer.errors import ConfigError
from trainer.model import attention, families
from trainer.planner.shape import ModelShape
from trainer.strategies.base import ModelSource, build_strategy

EXPECTED_ATTENTION = {f: "eager" if f == "gemma2" else "sdpa" for f in FAMILIES}
EXPECTED_TARGETS = {f: ("q_proj", "v_proj") for f in FAMILIES}
EXPECTED_TARGETS["phi3"] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def test_the_table_is_what_the_pinned_transformers_and_peft_say():
    assert transformers.__version__ == families.TRANSFORMERS_PIN
    assert peft.__version__ == families.PEFT_PIN
    for model_type, fam in families.FAMILIES.items():
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
        assert fam.causal_lm == name, model_type
        cls = getattr(transformers, name)
        flags = (cls._supports_sdpa, cls._supports_flash_attn, cls._supports_flex_attn)
        assert (fam.sdpa, fam.flash, fam.flex) == flags, model_type
        theirs = PEFT_TARGETS.get(model_type)
        assert fam.peft_targets == (tuple(theirs) if theirs else None), model_type
        assert fam.sdpa or fam.why_not_sdpa, model_type
    assert set(FAMILIES) == {k for k, f in families.FAMILIES.items() if f.checked}


def test_auto_attention_per_family_and_what_cannot_run_is_refused_in_one_line():
    for f in FAMILIES:
        assert families.resolve_attention("auto", {"model_type": f}) == EXPECTED_ATTENTION[f]
    assert families.resolve_attention("eager", {"model_type": "gemma2"}) == "eager"
    with pytest.raises(ConfigError) as exc:
        families.resolve_attention("sdpa", {"model_type": "gemma2"}, "m/config.json")
    msg = str(exc.value)
    assert "\n" not in msg and "Gemma2ForCausalLM (m/config.json)" in msg
    assert "model.attn_implementation: auto" in msg
    # An unknown family keeps the kernel asked for, and preflight warns in one line.
    notes = families.check(
        mconf={"model_type": "bloom"}, where="x", attention="auto", adapter="lora",
        targets="auto", pp=1,
    )  # fmt: skip
    assert len(notes) == 2 and all("\n" not in n for n in notes)
    assert "model_type bloom (x) has not been checked" in notes[0]
    with pytest.raises(ConfigError, match=r"strategy\.pp: model_type gemma2"):
        families.check(
            mconf={"model_type": "gemma2"}, where="x", attention="auto", adapter="none",
            targets="auto", pp=2,
        )  # fmt: skip


@pytest.fixture(scope="module")
def folders(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: build_family(root / f, f, tiny["model"]) for f in FAMILIES}


def _strategy(model_dir: Path, adapter: str, **model):
    cfg = load_config(
        {
            "model": {"path": str(model_dir), "adapter": adapter, **model},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "optim": {"lr": 1e-2},
            "scaling": {"num_workers": 1},
            "run": {"name": "families"},
        }
    )
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    s = build_strategy(cfg, torch.device("cpu"), 0, 1)
    s.setup(ModelSource(model_dir, vocab))
    s.model.train()
    return s, vocab


def _train(s, vocab: int) -> list[float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, vocab, (2, 16), generator=g)
    losses = []
    for _ in range(3):
        with s.precision():
            loss = s.model(input_ids=x, labels=x).loss
        s.backward(loss)
        s.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_and_exports_with_its_own_defaults(family, folders, tmp_path):
    """No attention setting and no LoRA targets in the job: the family's own are used, a
    few steps train, the export loads by the docs' recipe and computes what the trained
    model does, and the planner counts the model's and the adapter's parameters exactly."""
    model_dir = folders[family]
    mconf = json.loads((model_dir / "config.json").read_text())
    shape = ModelShape.from_hf_config(mconf)

    s, vocab = _strategy(model_dir, "lora")
    assert s.hf.config._attn_implementation == EXPECTED_ATTENTION[family]
    lora_a = [n.split(".lora_A.")[0] for n, _ in s.hf.named_parameters() if ".lora_A." in n]
    targeted = {n.rsplit(".", 1)[-1] for n in lora_a}
    assert targeted == set(EXPECTED_TARGETS[family])
    trainable = sum(p.numel() for p in s.hf.parameters() if p.requires_grad)
    assert trainable == shape.lora_params(8, "auto")
    losses = _train(s, vocab)
    assert losses[-1] < losses[0]
    s.export(tmp_path / "lora", 0, None)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    served = peft.PeftModel.from_pretrained(base, str(tmp_path / "lora" / "adapter")).eval()
    x = torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = s.hf.eval()(input_ids=x).logits
        assert torch.allclose(served(input_ids=x).logits, want, atol=1e-5)

    s, _ = _strategy(model_dir, "none")
    assert shape.params == sum(p.numel() for p in s.hf.parameters())
    losses = _train(s, vocab)
    assert losses[-1] < losses[0]
    s.export(tmp_path / "full", 0, None)
    served = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "full" / "model"))
    with torch.no_grad():
        want = s.hf.eval()(input_ids=x).logits
        assert torch.allclose(served.eval()(input_ids=x).logits, want, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_document_attention_is_exact_per_family(family, folders):
    """Two documents longer than the sliding window, packed in one row: logits equal each
    document run alone (fp32, ≤ 1e-5), with the family's kernel, sliding window and
    soft-capping; a mask without the window is not (where the family has one)."""
    model_dir = folders[family]
    attn = attention.resolve("auto", json.loads((model_dir / "config.json").read_text()))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), attn_implementation=attn.impl
    ).eval()
    lengths = (12, 20)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, model.config.vocab_size, (n,), generator=g) for n in lengths]
    ids = torch.cat(docs)[None]
    segs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        ref = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
        packed = model(
            input_ids=ids, **packing.attention_inputs(segs, attn.impl, **attn.mask_kwargs())
        )
        assert (packed.logits[0] - ref).abs().max() <= 1e-5
        if attn.window is not None:
            assert attn.window == WINDOW
            no_window = packing.attention_inputs(segs, attn.impl)
            wrong = model(input_ids=ids, **no_window).logits[0]
            assert (wrong - ref).abs().max() > 1e-3


@pytest.mark.parametrize("family", [f for f in FAMILIES if families.FAMILIES[f].pipeline])
def test_pipeline_stages_compute_the_whole_model_per_family(family, folders):
    """Two pipeline stages cut from the family's model, chained, give the whole model's
    logits (a sequence longer than Mistral's sliding window, so each stage must keep it)."""
    from trainer.parallel.pipeline import cut_to_stage

    model_dir = folders[family]

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()

    whole = load()
    x = torch.randint(
        3, whole.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        want = whole(input_ids=x).logits
        got = cut_to_stage(load(), 1, 2)(cut_to_stage(load(), 0, 2)(x))
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_fsdp2_keeps_tied_embeddings_tied(family, folders):
    """FSDP2 builds the model on the meta device and loads it sharded: a family that ties
    lm_head to embed_tokens must compute what the folder's model does (its lm_head was
    left as uninitialised memory, and Gemma 2 trained on NaN)."""
    model_dir = folders[family]
    cfg = load_config(
        {
            "model": {"path": str(model_dir)},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "strategy": {"name": "fsdp"},
            "scaling": {"num_workers": 1},
            "run": {"name": "tied"},
        }
    )
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    s = build_strategy(cfg, torch.device("cpu"), 0, 1)
    s.setup(ModelSource(model_dir, vocab))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    x = torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = s.model.eval()(input_ids=x).logits
        assert (got - ref(input_ids=x).logits).abs().max() <= 1e-5


def test_the_plan_says_what_the_family_gets_and_preflight_refuses_sdpa_for_gemma2(
    folders, tiny, tmp_path
):
    from trainer import preflight
    from trainer.planner import plan, report

    def job(family: str, **model: Any) -> Any:
        return load_config(
            {
                "model": {"path": str(folders[family]), "adapter": "lora", **model},
                "data": {"train_file": str(tiny["train"]), "block_size": 32},
                "scaling": {"num_workers": 1},
                "storage": {"path": str(tmp_path / "runs")},
                "run": {"name": "plan"},
            }
        )

    head = report.format_plan(plan.plan_job(job("gemma2"))).splitlines()[0]
    assert "lora r=8 on q_proj,v_proj" in head and head.endswith("eager attention")
    head = report.format_plan(plan.plan_job(job("phi3"))).splitlines()[0]
    assert "on qkv_proj,o_proj,gate_up_proj,down_proj" in head and "sdpa attention" in head
    # Eager attention on Gemma 2 draws no note; the one note is the data's shape (issue 54).
    notes = preflight.run_all(job("gemma2"), strict=False).notes
    assert [n for n in notes if not n.startswith("data.train_file")] == [], notes
    assert len(notes) == 1 and "read as" in notes[0], notes
    with pytest.raises(ConfigError) as exc:
        preflight.run_all(job("gemma2", attn_implementation="sdpa"), strict=False)
    assert str(exc.value).startswith("model.attn_implementation sdpa: Gemma2ForCausalLM (")


def test_fsdp2_lora_on_a_tied_family_with_grown_vocabulary_matches_ddp(folders):
    """Special tokens grow the vocabulary, so LoRA trains copies of embed_tokens and
    lm_head (modules_to_save); on a tied family the checkpoint holds that weight once, and
    FSDP2 must load lm_head's copies from it as DDP's from_pretrained does."""
    model_dir = folders["gemma2"]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"] + 2
    x = torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(9))
    out = []
    for name in ("ddp", "fsdp"):
        cfg = load_config(
            {
                "model": {"path": str(model_dir), "adapter": "lora"},
                "data": {"train_file": "unused.jsonl", "block_size": 16},
                "strategy": {"name": name},
                "scaling": {"num_workers": 1},
                "run": {"name": "tied-lora"},
            }
        )
        s = build_strategy(cfg, torch.device("cpu"), 0, 1)
        s.setup(ModelSource(model_dir, vocab))
        with torch.no_grad():
            out.append(s.model.eval()(input_ids=x).logits)
    assert torch.isfinite(out[1]).all()
    assert (out[0] - out[1]).abs().max() <= 1e-5
