"""The one generation engine: a single sequence is a batch of one."""

from .engine import Engine
from .storage import Conversation
from .types import EngineConfig, FinishReason, SpecStats, SpeculativeConfig, StepOutput

__all__ = ["Engine", "EngineConfig", "Conversation", "StepOutput", "FinishReason", "SpeculativeConfig", "SpecStats"]
