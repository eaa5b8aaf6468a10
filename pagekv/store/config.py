"""Frozen, validated configs for store nodes and clients (the CLI takes its defaults from here)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagekv import env
from pagekv.env import parse_size

from .wire.protocol import MAX_HEADER_BYTES

__all__ = [
    "ClientConfig",
    "CurveClientKeys",
    "NodeConfig",
    "default_copy_threads",
    "default_io_threads",
    "default_shm_threads",
    "default_streams",
    "normalize_endpoint",
    "parse_size",
]

MAX_STREAMS = 64


def default_streams(nodes: int = 1) -> int:
    """Connections per node a client of ``nodes`` nodes opens by default: one per 2 cores it
    may run on, up to 8 in all, shared out over the nodes (rounded up, at least 1 each).

    One stream is about one core's worth of work on each side (the kernel's copy out of the
    socket, the client's hashing of what landed), so the total, not the count per node, is
    what the host's cores bound: a 16-core host gets 8 for one node, 4 each for 2, 3 each for
    3. On the H100 host a 4 GiB connector prefetch from 3 nodes moved 15.4-16.8 GB/s over 3
    streams each and 12.6-13.5 over 4 each (three interleaved rounds); on the H200 host one
    from one node moved 12.4 GB/s over 4 streams, 18.6 over 8. A 2-core machine keeps a
    single stream."""
    together = min(8, max(1, _usable_cores() // 2))
    return max(1, -(-together // max(1, nodes)))


def default_io_threads() -> int:
    """ZeroMQ I/O threads of a node by default: one per 4 cores it may run on, 1 to 4 (the
    streams a client of two nodes opens to each; a client of one node opens up to twice as
    many, which share them)."""
    return min(4, max(1, _usable_cores() // 4))


def default_copy_threads() -> int:
    """Threads that check and copy received values (:mod:`.copies`): half the cores this
    process may run on, 1 to 8 (1: on the calling thread, no pool). A 2-core machine copies on
    its one client thread; 8 threads reach the host's memcpy ceiling on a 16-core H100 host."""
    return min(8, max(1, _usable_cores() // 2))


def lane_receive_helpers(connections: int) -> bool:
    """Whether each of a client's ``connections`` bulk lane connections receives with a helper
    thread (:meth:`.wire.native.NativeCopy.recv_verify` with a bounce of ``RECV_SLOTS``
    chunks): where the three threads a stream keeps busy (a same-host node's send, the
    receive, the helper that hashes and stores what landed) have a core each of those this
    process may run on. On the 16-core H100 host (two clients of one node taking turns, 24
    GETs of 256 MiB each) helpers moved 1.08x / 1.03x / 1.13x as much for 1 / 2 / 4 streams
    (4.64 against 4.11 GB/s for one), and 0.90x for 8, where the threads outnumber the
    cores."""
    return 3 * connections <= _usable_cores()


def default_shm_threads() -> int:
    """Threads of the same-host shortcut's copies (one native call per chunk of values): the
    cores this process may run on, up to 16. On the 16-core H100 host (bench_shm)
    8 threads read 17.6 GB/s out of a segment, 12 19.2 and 16 21.4: the copies are bound by
    memory, and more threads keep more of it busy."""
    return min(16, _usable_cores())


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


CONNECTION_OVERHEAD = 256 << 10  # libzmq session, pipes and buffers of one idle connection


def normalize_endpoint(text: str) -> str:
    """An endpoint as ZeroMQ takes it: ``tcp://host:port`` and ``ipc://path`` as they are,
    ``host:port`` (``[v6 address]:port``) as ``tcp://host:port``. Raises ``ValueError`` naming
    the text for anything else."""
    if not isinstance(text, str):
        raise ValueError(f"an endpoint must be a string, got {text!r}")
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    rest = text.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if sep and host.strip("[]") and "/" not in host and port.isdigit() and int(port) < 65536:
        return f"tcp://{rest}"
    raise ValueError(f"not an endpoint: {text!r} (host:port, tcp://host:port or ipc://path)")


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class NodeConfig:
    """One store node. ``endpoint`` (tcp:// or ipc://) overrides ``host``/``port``.

    Memory: the node holds at most ``capacity`` bytes of blocks (their real cost, see
    :mod:`.block_store`) plus, per connection, at most :attr:`connection_bound` bytes
    (requests being received, replies being sent; docs/protocol.md, "Node memory").

    Disk tier (``disk``: a directory of its own; :mod:`.node.disk`): blocks evicted from memory
    are kept there, up to ``disk_capacity`` bytes of files, in segment files of
    ``disk_segment_size``; ``disk_queue_size`` bytes of evicted blocks wait for the writer
    (memory beyond ``capacity``); ``disk_read_threads`` reads in flight; ``disk_promote``: a
    GET served from disk puts the block back into memory; ``disk_direct``: sealed segments are
    read with O_DIRECT. On SIGTERM the node spends up to ``shutdown_save_s`` writing its
    memory's blocks to the disk tier (most recently used first).

    KV events (``events_endpoint``; :mod:`.node.event_publisher`): the node publishes the
    blocks it stores and removes, per tier, in vLLM's KV-event format on a ZeroMQ PUB socket
    bound there, under ``events_topic``; ``events_replay_endpoint``: a ROUTER socket answering
    replay requests from the last ``events_buffer`` batches; ``events_queue``: keys waiting for
    the publisher thread before the node drops them and resyncs (sends all it holds).
    """

    host: str = "127.0.0.1"
    port: int = 7400
    endpoint: str | None = None
    capacity: int = 4 << 30
    max_block_size: int = 32 << 20  # one value, all its frames
    max_message_size: int = 32 << 20  # one request's or one reply's payload
    max_keys: int = 1 << 16
    max_frames: int = 1 << 16  # payload frames of one request
    verify_puts: bool = True
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    curve_secret_key: str | None = None  # path to a zmq certificate with a secret key
    curve_allow: str | None = None  # directory of allowed client public certificates
    io_threads: int = 0  # ZeroMQ I/O threads; 0: default_io_threads()
    # every connection's SO_SNDBUF/SO_RCVBUF (ZeroMQ, lane); 0: the kernel's autotuning, but
    # 256 KiB for a same-host lane connection's GET replies (wire.lane.size_socket_buffers)
    socket_buffer: int = 0
    window: int = 8  # requests a client may have outstanding on one connection
    recv_hwm: int = 2  # complete requests queued per connection before TCP pushes back
    max_connections: int = 1024  # also kept below the descriptor limit
    handshake_s: float = 10.0  # a connection that does not complete the ZMTP handshake is closed
    heartbeat_s: float = 10.0  # ZMTP heartbeats; a peer silent for 3x this is dropped; 0: off
    guard_interval_s: float = 0.02  # how often connections and RSS are checked; 0: no guard
    shm: bool = False  # keep blocks in a shared segment under /dev/shm (same-host shortcut)
    verify_threads: int = 0  # threads checking large PUTs; 0: default_copy_threads(); 1: none
    stream_ports: bool = True  # a TCP port per I/O thread, advertised to clients (see server)
    bulk: bool = True  # the bulk lane (plain TCP for PUTs and GETs); never with CURVE
    bulk_port: int = 0  # its TCP port; 0: any free port (clients learn it from PING)
    bulk_connections: int = 64  # bulk connections served at once; more are closed at once
    disk: str | None = None  # the disk tier's directory; None: memory only
    disk_capacity: int = 0  # bytes of the disk tier's files (needed with disk)
    disk_segment_size: int = 128 << 20  # one segment file: the unit of writing and reclaiming
    disk_queue_size: int = 128 << 20  # evicted blocks waiting for the disk writer
    disk_read_threads: int = 4
    disk_promote: bool = True  # a block served from disk goes back into memory
    disk_direct: bool = True  # read sealed segments with O_DIRECT where the file system has it
    shutdown_save_s: float = 30.0  # SIGTERM: seconds to write memory's blocks to the disk tier
    events_endpoint: str | None = None  # KV events' PUB socket (bound); None: no events
    events_replay_endpoint: str | None = None  # their replay ROUTER socket (bound); None: none
    events_topic: str = ""  # the topic frame of every event message
    events_buffer: int = 10_000  # batches kept for replay
    events_queue: int = 1 << 20  # keys waiting for the publisher; more: dropped, then a resync

    def __post_init__(self) -> None:
        for name in ("capacity", "max_block_size", "max_message_size", "disk_capacity",
                     "disk_segment_size", "disk_queue_size"):  # fmt: skip
            object.__setattr__(self, name, parse_size(getattr(self, name)))
        if self.io_threads == 0:
            object.__setattr__(self, "io_threads", default_io_threads())
        if self.verify_threads == 0:
            object.__setattr__(self, "verify_threads", default_copy_threads())
        _positive("NodeConfig", capacity=self.capacity, max_block_size=self.max_block_size,
                  max_message_size=self.max_message_size, max_keys=self.max_keys,
                  max_frames=self.max_frames, io_threads=self.io_threads, window=self.window,
                  verify_threads=self.verify_threads,
                  recv_hwm=self.recv_hwm, max_connections=self.max_connections,
                  handshake_s=self.handshake_s,
                  bulk_connections=self.bulk_connections)  # fmt: skip
        if self.max_block_size > self.max_message_size:
            raise ValueError(
                f"NodeConfig.max_block_size ({self.max_block_size}) must be <= "
                f"max_message_size ({self.max_message_size}): a block travels in one message"
            )
        for name in ("socket_buffer", "heartbeat_s", "guard_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"NodeConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("port", "bulk_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"NodeConfig.{name} must be in [0, 65536), got "
                                 f"{getattr(self, name)}")  # fmt: skip
        if self.endpoint is not None:
            try:
                object.__setattr__(self, "endpoint", normalize_endpoint(self.endpoint))
            except ValueError as e:
                raise ValueError(f"NodeConfig.endpoint: {e}") from None
        if (self.curve_secret_key is None) != (self.curve_allow is None):
            raise ValueError("NodeConfig: curve_secret_key and curve_allow go together")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("NodeConfig: need 0 < low_watermark <= high_watermark <= 1")
        self._check_disk()
        self._check_events()

    def _check_events(self) -> None:
        for name in ("events_endpoint", "events_replay_endpoint"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                object.__setattr__(self, name, normalize_endpoint(value))
            except ValueError as e:
                raise ValueError(f"NodeConfig.{name}: {e}") from None
        if self.events_replay_endpoint is not None and self.events_endpoint is None:
            raise ValueError("NodeConfig.events_replay_endpoint needs NodeConfig.events_endpoint")
        _positive("NodeConfig", events_buffer=self.events_buffer, events_queue=self.events_queue)

    def _check_disk(self) -> None:
        """The disk settings (the tier's own :class:`~.node.disk.DiskConfig` checks the same)."""
        if self.disk is None:
            return
        if not self.disk:
            raise ValueError("NodeConfig.disk: a directory is needed (or leave it unset)")
        segment = self.disk_segment_size
        if segment < (1 << 20) or segment % 4096:
            raise ValueError(f"NodeConfig.disk_segment_size must be >= 1 MiB and a multiple of "
                             f"4096, got {segment}")  # fmt: skip
        if self.disk_capacity < 2 * segment:
            raise ValueError(f"NodeConfig.disk_capacity must hold at least two segments "
                             f"(2 x NodeConfig.disk_segment_size = {2 * segment} bytes), got "
                             f"{self.disk_capacity}")  # fmt: skip
        _positive("NodeConfig", disk_queue_size=self.disk_queue_size,
                  disk_read_threads=self.disk_read_threads)  # fmt: skip
        if self.disk_read_threads > 64:
            raise ValueError(f"NodeConfig.disk_read_threads must be <= 64, got "
                             f"{self.disk_read_threads}")  # fmt: skip
        if self.shutdown_save_s < 0:
            raise ValueError(f"NodeConfig.shutdown_save_s must be >= 0, got "
                             f"{self.shutdown_save_s}")  # fmt: skip

    @property
    def bind_address(self) -> str:
        return self.endpoint or f"tcp://{self.host}:{self.port}"

    @property
    def max_frame_size(self) -> int:
        """Largest single frame accepted (``ZMQ_MAXMSGSIZE``; a larger one disconnects its
        sender): a request's whole payload or a header. A frame over ``max_block_size`` but
        within this gets a per-key ``TOO_LARGE``."""
        return max(self.max_message_size, MAX_HEADER_BYTES)

    @property
    def connection_bound(self) -> int:
        """Bytes one connection can make the node hold beyond its capacity (documented in
        docs/protocol.md): requests queued and being received, plus reply bytes in flight."""
        inbound = (self.recv_hwm + 1) * (self.max_message_size + MAX_HEADER_BYTES)
        outbound = 2 * (self.max_message_size + MAX_HEADER_BYTES)
        return inbound + outbound + CONNECTION_OVERHEAD

    def limits(self) -> dict[str, int]:
        """What clients learn from a PING reply (``limits``) and split their batches by."""
        return {"max_keys": self.max_keys, "max_frames": self.max_frames,
                "max_message_size": self.max_message_size, "max_block_size": self.max_block_size,
                "max_header_size": MAX_HEADER_BYTES, "window": self.window}  # fmt: skip


@dataclass(frozen=True)
class CurveClientKeys:
    """Z85 keys for a client of CURVE-secured nodes."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_cert: str, client_cert: str) -> CurveClientKeys:
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(server_cert)
        public, secret = zmq.auth.load_certificate(client_cert)
        if secret is None:
            raise ValueError(f"{client_cert} has no secret key")
        return cls(server_public, public, secret)


@dataclass(frozen=True)
class ClientConfig:
    """Which nodes, how many replicas, and how long to wait.

    A request to a node is given up after ``timeout_s + timeout_per_mib_s * MiB`` without an
    answer, where MiB counts the bytes in flight to and from that node (so a large healthy
    transfer is not mistaken for a dead node). A node whose connection is not up within
    ``connect_timeout_s`` (default and cap: ``timeout_s``) of its socket's creation is down:
    calls fail for it at once until it connects. Failed nodes are backed off (``backoff_min_s``
    doubling to ``backoff_max_s``) and tried only as a last resort while their connection is
    up again.

    ``streams`` (default: :func:`default_streams` of the node count) is how many connections
    the client keeps to each node; a batch's requests to a node are spread over them, each
    with its own window of ``window`` requests in flight and its own deadline, and the client's
    zmq context gets as many I/O threads (see docs/protocol.md, "Streams"). ``copy_threads``
    (default :func:`default_copy_threads`) check and copy the values of GET replies into the
    caller's buffers and checksum large put batches, on a pool shared by the process's
    clients; 1 does that work on the client's own thread, and then PUT requests carry at most
    4 MiB (``client.client.INLINE_PUT_BYTES``: each is hashed before it is sent).

    Transports (:mod:`.client.transport`; each node's chosen from its PING reply): ``shm``
    (default ``PAGEKV_SHM_CLIENT``, on): GETs of a ``--shm`` node on this host are copied
    straight out of its segment. ``bulk`` (default ``PAGEKV_BULK_CLIENT``, on): GETs of a node
    that offers a bulk lane go over it (plain TCP, received straight into place and hashed as
    they land), ``streams`` connections per node, when this process has the native library.
    Everything else goes over ZeroMQ.
    """

    endpoints: tuple[str, ...]
    replicas: int = 1
    timeout_s: float = 5.0
    timeout_per_mib_s: float = 0.01  # 100 MiB/s: far below any healthy link
    backoff_min_s: float = 0.25
    backoff_max_s: float = 8.0
    curve: CurveClientKeys | None = None
    socket_buffer: int = 0  # 0: autotuning, 256 KiB for same-host GET replies (lane)
    max_message_bytes: int = 16 << 20  # requests are also cut to each node's advertised limits
    connect_timeout_s: float | None = None  # None: timeout_s
    streams: int | None = None  # connections per node; None: default_streams(len(endpoints))
    copy_threads: int | None = None  # None: default_copy_threads(); 1: no pool
    bulk: bool | None = None  # PUTs and GETs over nodes' bulk lanes; None: PAGEKV_BULK_CLIENT (on)
    shm: bool | None = None  # GETs out of same-host --shm segments; None: PAGEKV_SHM_CLIENT (on)

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            object.__setattr__(self, "endpoints", (self.endpoints,))
        try:
            endpoints = tuple(normalize_endpoint(ep) for ep in self.endpoints)
        except ValueError as e:
            raise ValueError(f"ClientConfig.endpoints: {e}") from None
        object.__setattr__(self, "endpoints", endpoints)
        if not self.endpoints or len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError("ClientConfig.endpoints must be distinct and non-empty")
        if not 1 <= self.replicas <= len(self.endpoints):
            raise ValueError(
                f"ClientConfig.replicas must be in [1, {len(self.endpoints)}], got {self.replicas}"
            )
        if self.connect_timeout_s is None:
            object.__setattr__(self, "connect_timeout_s", self.timeout_s)
        if self.streams is None:
            object.__setattr__(self, "streams", default_streams(len(self.endpoints)))
        if type(self.streams) is not int or not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(
                f"ClientConfig.streams must be an int in [1, {MAX_STREAMS}], got {self.streams!r}"
            )
        if self.copy_threads is None:
            object.__setattr__(self, "copy_threads", default_copy_threads())
        if self.bulk is None:
            object.__setattr__(self, "bulk", env.BULK_CLIENT.get())
        if self.shm is None:
            object.__setattr__(self, "shm", env.SHM_CLIENT.get())
        for name in ("bulk", "shm"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"ClientConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if type(self.copy_threads) is not int or not 1 <= self.copy_threads <= MAX_STREAMS:
            raise ValueError(
                f"ClientConfig.copy_threads must be an int in [1, {MAX_STREAMS}], "
                f"got {self.copy_threads!r}"
            )
        if isinstance(self.timeout_per_mib_s, bool) or not self.timeout_per_mib_s >= 0:
            raise ValueError(
                f"ClientConfig.timeout_per_mib_s must be >= 0, got {self.timeout_per_mib_s!r}"
            )
        _positive(
            "ClientConfig", timeout_s=self.timeout_s, backoff_min_s=self.backoff_min_s,
            backoff_max_s=self.backoff_max_s, max_message_bytes=self.max_message_bytes,
            connect_timeout_s=self.connect_timeout_s,
        )  # fmt: skip

    def timeout_for(self, nbytes: int) -> float:
        """Seconds to wait for an answer with ``nbytes`` in flight (sent and expected)."""
        return self.timeout_s + self.timeout_per_mib_s * nbytes / (1 << 20)
