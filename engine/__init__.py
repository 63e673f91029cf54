"""kubesgl's serving engine: `from kubesgl.engine import LLM, SamplingParams`."""

from kubesgl.engine.llm import LLM, RequestOutput
from kubesgl.engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "InvalidRequestError"]
