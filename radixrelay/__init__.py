"""radixrelay: LLM serving for prompt-sharing workloads (radix prefix cache + cascaded attention)."""

from radixrelay.engine import Engine
from radixrelay.outputs import RequestOutput
from radixrelay.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
