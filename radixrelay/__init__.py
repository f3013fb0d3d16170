"""radixrelay: LLM serving for prompt-sharing workloads (radix prefix cache + cascaded attention).

``Engine`` is imported lazily so that torch-free parts (scheduler, radix tree, server protocol)
can be imported without loading torch.
"""

from typing import TYPE_CHECKING, Any

from radixrelay.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixrelay.engine import Engine
    from radixrelay.outputs import RequestOutput

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixrelay.engine import Engine

        return Engine
    if name == "RequestOutput":
        from radixrelay.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'radixrelay' has no attribute {name!r}")
