"""pagekv.store: ZeroMQ store nodes and clients moving page blocks (see docs/protocol.md)."""
