"""The demo agent: a scripted order-handling agent with tools of every recovery kind.

It needs no API key: a ScriptedModel answers Step n of every Run with entry n.
Every tool records its effect in an ``EffectLedger`` (a SQLite file named by
RATCHET_LEDGER) that outlives any process, so the demo and the tests can show
that no ``never_replay`` effect ever happened twice.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from contextlib import closing
from pathlib import Path

from runtime.agent import Agent
from runtime.models import ModelResponse, ScriptedModel, call
from runtime.tools import ToolContext, tool

TOOL_LATENCY_S = 0.15
MODEL_LATENCY_S = 0.05


class EffectLedger:
    """Side effects by operation id, in a file that survives every process death."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS effects (operation_id TEXT, tool TEXT,"
                " attempt INTEGER, pid INTEGER, note TEXT)"
            )

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    def record(self, ctx: ToolContext, tool_id: str, note: str = "") -> None:
        with closing(self._connect()) as db:
            db.execute(
                "INSERT INTO effects VALUES (?, ?, ?, ?, ?)",
                (ctx.operation_id, tool_id, ctx.attempt, os.getpid(), note),
            )

    def rows(self, operation_prefix: str = "") -> list[tuple[str, str, int, int, str]]:
        with closing(self._connect()) as db:
            return db.execute(
                "SELECT operation_id, tool, attempt, pid, note FROM effects"
                " WHERE operation_id LIKE ? ORDER BY rowid",
                (f"%{operation_prefix}%",),
            ).fetchall()

    def duplicates(self, tools: tuple[str, ...]) -> list[str]:
        """Operation ids of the given tools that ran more than once."""
        with closing(self._connect()) as db:
            marks = ",".join("?" * len(tools))
            rows = db.execute(
                f"SELECT operation_id FROM effects WHERE tool IN ({marks})"
                " GROUP BY operation_id HAVING COUNT(*) > 1",
                tools,
            ).fetchall()
        return [r[0] for r in rows]


def ledger() -> EffectLedger | None:
    path = os.environ.get("RATCHET_LEDGER")
    return EffectLedger(path) if path else None


def _record(ctx: ToolContext, tool_id: str) -> None:
    book = ledger()
    if book is not None:
        book.record(ctx, tool_id)


@tool(recovery=("replay_safe", "never_replay"))
async def lookup_order(order: str, ctx: ToolContext) -> dict[str, str]:
    """Read an order (no side effect: safe to run again)."""
    await asyncio.sleep(TOOL_LATENCY_S)
    _record(ctx, "lookup_order")
    return {"order": order, "items": "3", "total": "42.00"}


@tool
async def reserve_stock(order: str, ctx: ToolContext) -> str:
    """Reserve the order's items (an effect: never replayed)."""
    await asyncio.sleep(TOOL_LATENCY_S)
    _record(ctx, "reserve_stock")
    return f"reserved stock for {order}"


@tool
async def charge_card(order: str, amount: float, ctx: ToolContext) -> str:
    """Charge the customer (an effect: never replayed)."""
    await asyncio.sleep(TOOL_LATENCY_S)
    _record(ctx, "charge_card")
    return f"charged {amount:.2f} for {order} (idempotency key {ctx.operation_id})"


@tool(recovery=("replay_safe",))
async def send_receipt(order: str, ctx: ToolContext) -> str:
    """Send the receipt; the mail service deduplicates by operation id, so replay is safe."""
    await asyncio.sleep(TOOL_LATENCY_S)
    _record(ctx, "send_receipt")
    return f"receipt for {order} queued"


SCRIPT = (
    ModelResponse(
        text="Let me look the order up and reserve it.",
        tool_calls=(
            call("lookup_order", "c1", order="A-1"),
            call("reserve_stock", "c2", order="A-1"),
        ),
    ),
    ModelResponse(
        text="Charging the card.", tool_calls=(call("charge_card", "c3", order="A-1", amount=42),)
    ),
    ModelResponse(
        text="Sending the receipt.",
        tool_calls=(
            call("send_receipt", "c4", order="A-1"),
            call("lookup_order", "c5", order="A-1"),
        ),
    ),
    ModelResponse(text="Order A-1 is reserved, charged and the receipt is on its way."),
)
NEVER_REPLAY_TOOLS = ("reserve_stock", "charge_card")


def demo_agent() -> Agent:
    return Agent(
        name="order-desk",
        model=ScriptedModel(SCRIPT, latency_s=MODEL_LATENCY_S),
        tools=(lookup_order, reserve_stock, charge_card, send_receipt),
        max_steps=8,
    )


agent = demo_agent()
"""``cluster.demo_agent:agent``: what ``ratchet demo`` runs."""
