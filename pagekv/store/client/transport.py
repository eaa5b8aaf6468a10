"""What carries a client's calls to its nodes: one interface, three adapters, one choice per node.

* :class:`.zeromq.ZmqTransport`: ZeroMQ DEALER sockets, ``streams`` per node. Every node has it;
  it carries PING, STATS, EXISTS, DELETE (and LOCATE, RESERVE, COMMIT for the shortcut below),
  and PUTs and GETs where nothing faster is chosen.
* :class:`.lane.LaneTransport`: the node's bulk lane (plain TCP), PUTs and GETs: PUT values
  sent straight from the caller's buffers and received by the node into new blocks, GET
  replies received straight into their destinations, both by the native receive.
* :class:`.shm.ShmTransport`: a ``--shm`` node on this host: GETs copied straight out of its
  segment (a LOCATE over ZeroMQ, then checked copies), and PUTs written straight into it
  (RESERVE, checked copies, COMMIT) where the node takes them.

A node's transports are chosen from its PING reply and the client's settings (:func:`choose`
for GETs: the shortcut, else the lane, else ZeroMQ; PUTs: the shortcut where the node takes
its writes, else the lane, else ZeroMQ), once per PING: never per call, never by a fallback in
the middle of a batch. A transport that fails a node's call fails it as any node failure does
(its keys move on to their next node or become misses); the client then replaces the node's
ZeroMQ links and PINGs it again before its next use, which chooses its transports again.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from .routing import Call, Results

__all__ = ["MOVED", "Route", "Transport", "choose", "gather_all"]

T = TypeVar("T")

# A call's result from a transport that found the node's address for it gone (the lane of a
# node that restarted on another port): the client PINGs the node, chooses its transports
# again and runs the call once more.
MOVED: Any = type("Moved", (), {"__repr__": lambda self: "MOVED"})()


class Transport(abc.ABC):
    """Carries calls to the nodes it was chosen for (one instance per client and kind, serving
    all of them; used on the client's event loop only).

    :meth:`run` contract:

    * Every call of ``calls`` gets an entry in the result: ``(reply, frames)``, or ``None`` when
      the node failed that request (no answer within ``ClientConfig.timeout_for`` its bytes in
      flight, or within its ``answer_s``; a reset; a malformed reply), or :data:`MOVED`.
    * As each reply arrives, the call's ``prepare`` (if any) runs, on a copy thread or on the
      loop's, then its ``on_reply`` on the loop's thread, before :meth:`run` returns.
    * Buffers: a call's ``payloads`` are read and its ``sinks`` written only until :meth:`run`
      returns or raises. A :meth:`run` that is cancelled, or whose ``on_reply`` raised, stops
      its transfers and waits for them before it re-raises: the caller may reuse its buffers
      as soon as it gets control back.
    * It never raises for a node's failure.
    """

    name: str

    @abc.abstractmethod
    async def run(self, calls: list[Call]) -> Results: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Close every connection; calls in flight end (their results None)."""


@dataclass(frozen=True)
class Route:
    """How one node's GETs travel: ``get`` is ``"zmq"``, ``"lane"`` or ``"shm"``; ``why`` says
    why it is not a faster one (empty when it is the fastest this node and client can have).
    PUTs take the lane wherever GETs take the lane or the shortcut and the lane was taken too
    (the shortcut's own writes first, where the node takes them)."""

    get: str
    why: str = ""


def choose(shm: str | None, lane: str | None) -> Route:
    """The GET route of a node: ``shm`` / ``lane`` are "" where that transport took the node
    (see :meth:`.shm.ShmTransport.take`, :meth:`.lane.LaneTransport.take`), else why not
    (None: not offered by the node or turned off in the client)."""
    if shm == "":
        return Route("shm")
    if lane == "":
        return Route("lane", f"shm: {shm}" if shm else "")
    why = "; ".join(f"{name}: {text}" for name, text in (("shm", shm), ("lane", lane)) if text)
    return Route("zmq", why)


async def gather_all(jobs: Iterable[Awaitable[T]]) -> list[T]:
    """Run ``jobs`` at once and return their results, in order. If one raises, or this call is
    cancelled, the others are cancelled and waited for (transfers that write into the caller's
    buffers must have stopped) before the error is raised."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        while not all(task.done() for task in tasks):
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError:
                continue  # cancelled again: the transfers must still stop first
        for task in tasks:  # retrieved: no "exception was never retrieved" for the others
            if not task.cancelled():
                task.exception()
        raise
