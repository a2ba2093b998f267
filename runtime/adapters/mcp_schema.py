"""JSON Schema validators for an MCP server's tool schemas, without its regular
expressions.

A server's ``inputSchema`` checks the model's arguments before a call is sent, and its
``outputSchema`` checks each result (the SDK's ``validate_tool_result``). Both ran the
server's ``pattern`` and ``patternProperties`` through Python's ``re``, on the host's
event loop and with no timeout: ``^(a+)+$`` against 30 characters held every Run of the
host for half a minute, past the call's own deadline. A server's expressions are left
to the server (which checks its own arguments, and answers for its own results); every
other keyword is checked as before. ``jsonschema`` comes with the ``mcp`` SDK.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcp import ClientSession

UNCHECKED = ("pattern", "patternProperties")
"""Keywords whose check runs a regular expression the server chose."""


def _unchecked(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
    return iter(())


def schema_validator(schema: dict[str, Any]) -> Any:
    """A validator of ``schema`` (its draft's) that checks no server expression. Its
    ``$ref`` resolve inside the schema, never over the network. Raises jsonschema's
    SchemaError for a schema that is none, RecursionError for one nested past Python's
    limit."""
    from jsonschema.validators import extend, validator_for
    from referencing import Registry

    kind = validator_for(schema)
    kind.check_schema(schema)
    lenient = extend(kind, validators=dict.fromkeys(UNCHECKED, _unchecked))
    return lenient(schema, registry=Registry())


@functools.cache
def session_class() -> type[ClientSession]:
    """The SDK's ClientSession, checking results against each tool's outputSchema with
    ``schema_validator``. (The SDK builds its validator in ``_output_schema_validator``,
    which this replaces; a test holds the SDK to it.)"""
    from jsonschema import SchemaError
    from mcp import ClientSession

    class Session(ClientSession):
        _checks: dict[str, tuple[dict[str, Any], Any]]

        def _output_schema_validator(self, name: str, output_schema: dict[str, Any]) -> Any:
            checks = self.__dict__.setdefault("_checks", {})
            cached = checks.get(name)
            if cached is not None and cached[0] == output_schema:
                return cached[1]  # built once per schema: building costs more than a check
            try:
                validator = schema_validator(output_schema)
            except (SchemaError, RecursionError) as exc:
                raise RuntimeError(f"Invalid schema for tool {name}: {exc}") from exc
            checks[name] = (output_schema, validator)
            return validator

    return Session
