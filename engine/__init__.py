"""pdserve's execution trunk: scheduler -> BatchInputBuilder -> ForwardInput -> forward ->
logits on selected rows -> Sampler. Knows nothing of gRPC or etcd.

`from engine import LLM, SamplingParams` is the offline API (vLLM's convention).
"""

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in the models and torch; import it on first use only.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
