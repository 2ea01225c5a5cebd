"""Memory-fit estimation for llama.cpp servers: GGUF header reader, model facts, memory model.

``read_header`` (local path or http(s) URL, header only) -> ``model_spec`` -> ``resolve_settings``
(the engine's defaults) -> ``estimate`` (weights, KV and compute per device). The planner uses
``largest_fitting_context`` to find the biggest context a device budget allows.

Compute buffers: ``graph`` builds the engine's worst-case graph for a model (tensor by tensor, over
``ggml``'s symbolic tensors) and ``sched`` places it on the backends and sizes each backend's buffer
with the engine's scheduler and allocator rules.
"""

from controller.stages.estimate.gguf_header import GGUFHeader, GGUFHeaderError, read_header
from controller.stages.estimate.memory import Estimate, Settings, estimate, largest_fitting_context, resolve_settings
from controller.stages.estimate.model import ModelSpec, model_spec

__all__ = [
    "Estimate", "GGUFHeader", "GGUFHeaderError", "ModelSpec", "Settings", "estimate", "largest_fitting_context",
    "model_spec", "read_header", "resolve_settings",
]
