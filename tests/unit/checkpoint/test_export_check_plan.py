"""The planner's export phase counts the checks that follow the write: the merged folder's
reference (a second fp32 base with the adapter) and, with export.formats gguf, each
type's writer and the dequantized read-back, on Llama-2-7B's shape. No torch."""

from __future__ import annotations

import pytest

from tests.support.jobs import LLAMA2_7B, llama7b_job
from trainer.config import load_config
from trainer.planner import memory as PM
from trainer.planner.memory import Setup, rank_memory
from trainer.planner.shape import ModelShape

L7 = ModelShape.from_hf_config(LLAMA2_7B)
M = L7.params


def _host(s: Setup) -> PM.HostMemory:
    return PM.host_memory(L7, s, rank_memory(L7, s))


def test_the_merged_check_is_a_step_of_the_export_phase() -> None:
    s = Setup("fsdp", world=8, adapter="lora", merge_on_export=True)
    lora = 4.0 * L7.lora_params(s.lora_r, list(s.lora_targets))
    steps = PM.export_steps(L7, s)
    assert steps == {"write": lora + 8.0 * M, "check merged": 4.0 * M + lora}
    # The merge's fresh base and its serialisation stay the peak; the check runs after.
    assert _host(s).export == pytest.approx(lora + 8.0 * M)
    plain = PM.export_steps(L7, Setup("fsdp", world=8, adapter="lora"))
    assert plain == {"write": lora}


def test_gguf_read_back_raises_a_full_fine_tunes_export_peak(tmp_path) -> None:
    hf_only = Setup("fsdp", world=8)
    assert _host(hf_only).export == 4.0 * M  # the gathered fp32 state dict
    s = Setup("fsdp", world=8, gguf_types=("f16", "q8_0"))
    steps = PM.export_steps(L7, s)
    assert steps["gguf f16"] == 2.0 * M and steps["gguf q8_0"] == pytest.approx(34 / 32 * M)
    assert _host(s).export == 8.0 * M  # the dequantized state dict and the model it fills
    # From the job: gguf's types reach the plan only when gguf is among the formats.
    job = llama7b_job(tmp_path, export={"formats": ["hf", "gguf"], "gguf_types": ["q8_0"]})
    assert Setup.from_config(load_config(job)).gguf_types == ("q8_0",)
    job = llama7b_job(tmp_path, export={"formats": ["hf"], "gguf_types": ["q8_0"]})
    assert Setup.from_config(load_config(job)).gguf_types == ()
