"""Model adapters for real providers: the Model port (``runtime.models``) on their SDKs.

- ``OpenAICompatible``: OpenAI Chat Completions and the servers that copy it (vLLM,
  Ollama, LiteLLM ...), on the ``openai`` SDK (extra ``ratchet[openai]``);
- ``AnthropicModel``: Anthropic's Messages API, on the ``anthropic`` SDK (extra
  ``ratchet[anthropic]``).

An SDK is imported when its adapter is constructed, never when this package is: a
process that uses neither loads neither. Each adapter translates its SDK's failures into
the ModelError tree in one shared place (``runtime.adapters.errors``).
"""

from runtime.adapters.anthropic import AnthropicModel
from runtime.adapters.openai_compat import OpenAICompatible
from runtime.adapters.usage import Usage

__all__ = ["AnthropicModel", "OpenAICompatible", "Usage"]
