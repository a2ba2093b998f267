"""Agents on a real adapter for the Ray tests (``tests.ray.model_agents:name``).

The fake provider (``tests.adapters.fake_provider``) runs in the test process; the
agent learns its address from ``RATCHET_TEST_PROVIDER`` in the environment of the
process that builds it (the test sets it for itself, as the client builds the agent
to check it, and in the hosts' runtime env).
"""

from __future__ import annotations

import os

from runtime.adapters import AnthropicModel, OpenAICompatible
from runtime.agent import Agent

PROVIDER_ENV = "RATCHET_TEST_PROVIDER"


def openai_agent() -> Agent:
    base_url = f"{os.environ[PROVIDER_ENV]}/v1"
    model = OpenAICompatible("gpt-test", base_url=base_url, api_key="sk-test", timeout_s=30)
    return Agent(name="on_openai", model=model, system="You answer.")


def anthropic_agent() -> Agent:
    model = AnthropicModel(
        "claude-test", base_url=os.environ[PROVIDER_ENV], api_key="sk-test", timeout_s=30
    )
    return Agent(name="on_anthropic", model=model, system="You answer.")
