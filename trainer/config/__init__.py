"""The one job config: loaded from YAML, validated once, passed as-is to every worker.

A module per section (model, data, strategy, train and its objectives, scaling, checkpoint
and storage, run and tracking); `job` holds the checks that span sections and `loader` the
YAML, the overrides and the error lines. Everything here is pure (pydantic + PyYAML only)
so `tools/` can validate a job on a laptop without torch or Ray. Checks that need the
model's own config.json or the data files live in `trainer.preflight`, which runs on the
client and again on the cluster before workers are started.
"""

from trainer.config.base import STRATEGIES
from trainer.config.checkpoint import CheckpointSection, StorageSection
from trainer.config.data import DataSection, SourceSpec
from trainer.config.export import ExportSection
from trainer.config.job import JobConfig
from trainer.config.loader import apply_overrides, load_config, parse_override
from trainer.config.model import LoraSection, ModelSection
from trainer.config.run import (
    MlflowTracking,
    RunSection,
    TensorBoardTracking,
    TrackingSection,
    WandbTracking,
)
from trainer.config.scaling import ScalingSection
from trainer.config.strategy import DDPOptions, DeepSpeedOptions, FSDPOptions, StrategyOptions
from trainer.config.train import (
    OBJECTIVES,
    PREFERENCE_BETA,
    OptimSection,
    PreferenceSection,
    TrainSection,
)
from trainer.errors import ConfigError

__all__ = [
    "OBJECTIVES",
    "PREFERENCE_BETA",
    "STRATEGIES",
    "CheckpointSection",
    "ConfigError",
    "DDPOptions",
    "DataSection",
    "DeepSpeedOptions",
    "ExportSection",
    "FSDPOptions",
    "JobConfig",
    "LoraSection",
    "MlflowTracking",
    "ModelSection",
    "OptimSection",
    "PreferenceSection",
    "RunSection",
    "ScalingSection",
    "SourceSpec",
    "StorageSection",
    "StrategyOptions",
    "TensorBoardTracking",
    "TrackingSection",
    "TrainSection",
    "WandbTracking",
    "apply_overrides",
    "load_config",
    "parse_override",
]
