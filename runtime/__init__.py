"""Runtime: load an artifact and serve it."""

from optc.runtime.engine import Completion, Engine, EngineConfig, EngineStats
from optc.runtime.sampler import SamplingParams

__all__ = ["Completion", "Engine", "EngineConfig", "EngineStats", "SamplingParams"]
