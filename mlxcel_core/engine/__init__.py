"""The one generation engine: a single sequence is a batch of one."""

from .engine import Engine
from .storage import Conversation
from .types import EngineConfig, FinishReason, StepOutput

__all__ = ["Engine", "EngineConfig", "Conversation", "StepOutput", "FinishReason"]
