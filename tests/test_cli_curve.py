"""CURVE that can be diagnosed: the node logs refused keys, the client says "authentication
failed" (and why) rather than "unreachable", bad --curve-allow refuses to start, '*' is logged;
`cluster` takes the same options. Installed `pagekv` script, loopback, free ports."""

import json
import re

import pytest
import zmq.auth

from pagekv.store.node.auth import write_keypair
from tests.cli_helpers import Node, Proc, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture
def keys(tmp_path):
    """server pair; allowed client 'good' (its public key in allow/); unknown client 'bad'."""
    out = {}
    for where, name in ((tmp_path, "server"), (tmp_path / "allow", "good"), (tmp_path, "bad")):
        out[name] = write_keypair(str(where), name)  # (public, secret)
    (tmp_path / "allow" / "good.key_secret").rename(tmp_path / "good.key_secret")
    out["good"] = (out["good"][0], str(tmp_path / "good.key_secret"))
    out["allow"] = str(tmp_path / "allow")
    return out


def client_args(server_cert, client_secret):
    return ["--curve-server-cert", server_cert, "--curve-client-cert", client_secret]


def test_failures_are_named_on_both_sides(keys):
    node = Node("--capacity", "8MiB", "--curve-secret-key", keys["server"][1], "--curve-allow",
                keys["allow"])  # fmt: skip
    try:
        good = client_args(keys["server"][0], keys["good"][1])
        assert run_cli("ping", node.address, *good).returncode == 0
        refused = run_cli("ping", node.address, "--count", "1", "--timeout", "5",
                          *client_args(keys["server"][0], keys["bad"][1]))  # fmt: skip
        assert refused.returncode == 1
        assert refused.stdout.startswith(f"{node.address} authentication failed: the node "
                                         "refused this client's key"), refused.stdout  # fmt: skip
        bad_public = zmq.auth.load_certificate(keys["bad"][0])[0].decode()
        line = node.wait_line(r"rejected CURVE client key (\S+) from 127\.0\.0\.1")
        assert line.group(1) == bad_public  # the key id an operator can grep for
        wrong_server = run_cli("ping", node.address, "--count", "1", "--timeout", "5",
                               *client_args(keys["bad"][0], keys["good"][1]))  # fmt: skip
        assert wrong_server.returncode == 1
        assert "authentication failed" in wrong_server.stdout
        assert "--curve-server-cert" in wrong_server.stdout
        node.wait_line("wrong server public key")
        plain = run_cli("ping", node.address, "--count", "1", "--timeout", "5")
        assert plain.returncode == 1 and "authentication failed" in plain.stdout, plain.stdout
        assert "requires CURVE" in plain.stdout
        stats = run_cli("stats", "--json", node.address, *good)
        assert json.loads(stats.stdout)["nodes"][0]["stats"]["auth_rejected"] >= 1
        table = run_cli("stats", node.address, "--timeout", "5",
                        *client_args(keys["server"][0], keys["bad"][1]))  # fmt: skip
        assert table.returncode == 1 and "authentication failed" in table.stdout
        assert "unreachable" not in refused.stdout + wrong_server.stdout + table.stdout
    finally:
        assert node.stop() == 0
    assert "Traceback" not in node.log


def test_bad_allow_directory_refuses_to_start(keys, tmp_path):
    (tmp_path / "empty").mkdir()
    for allow, message in ((tmp_path / "missing", "no such directory"),
                           (tmp_path / "empty", "holds no public certificate")):  # fmt: skip
        out = run_cli("serve", "--port", "0", "--curve-secret-key", keys["server"][1],
                      "--curve-allow", allow)  # fmt: skip
        assert out.returncode == 2 and message in out.stderr, out.stderr
    out = run_cli("serve", "--port", "0", "--curve-secret-key", keys["server"][0],
                  "--curve-allow", keys["allow"])  # fmt: skip
    assert out.returncode == 2 and "has no secret key" in out.stderr


def test_allow_any_is_logged_and_admits_any_key(keys):
    node = Node("--capacity", "8MiB", "--curve-secret-key", keys["server"][1], "--curve-allow",
                "*")  # fmt: skip
    try:
        assert "any client key is accepted" in node.log
        anyone = client_args(keys["server"][0], keys["bad"][1])
        assert run_cli("ping", node.address, *anyone).returncode == 0
        assert run_cli("ping", node.address, "--count", "1", "--timeout", "5").returncode == 1
    finally:
        assert node.stop() == 0


def test_cluster_takes_curve_options_from_env(keys):
    env = {"PAGEKV_CURVE_SECRET_KEY": keys["server"][1], "PAGEKV_CURVE_ALLOW": keys["allow"]}
    cluster = Proc("cluster", "--nodes", "2", "--base-port", "0", "--capacity", "8MiB", env=env)
    try:
        ready = cluster.wait_line(r"pagekv cluster ready: 2 nodes: (.+)$")
        addresses = ready.group(1).split()
        good = client_args(keys["server"][0], keys["good"][1])
        out = run_cli("ping", *addresses, *good)
        assert out.returncode == 0 and out.stdout.count(" ok ") == 2, out.stdout
        out = run_cli("ping", "--count", "1", "--timeout", "5", *addresses)
        assert out.returncode == 1
        assert len(re.findall("authentication failed", out.stdout)) == 2, out.stdout
    finally:
        assert cluster.stop() == 0


def test_library_clients_tell_refused_keys_from_dead_nodes(keys):
    """StoreClient/AsyncStoreClient.stats(): AuthenticationFailed for a refused key,
    StoreUnavailable (and not AuthenticationFailed) for a node that is not there."""
    import asyncio
    import socket

    from pagekv.errors import AuthenticationFailed, StoreUnavailable
    from pagekv.store import AsyncStoreClient, CurveClientKeys, StoreClient

    node = Node("--capacity", "8MiB", "--curve-secret-key", keys["server"][1], "--curve-allow",
                keys["allow"])  # fmt: skip
    try:
        good = CurveClientKeys.from_files(keys["server"][0], keys["good"][1])
        bad = CurveClientKeys.from_files(keys["server"][0], keys["bad"][1])
        with StoreClient(node.address, curve=good, timeout_s=2) as c:
            assert c.stats()[0] is not None
        with StoreClient(node.address, curve=bad, timeout_s=1) as c:
            with pytest.raises(AuthenticationFailed, match="authentication failed"):
                c.stats()

        async def refused():
            client = AsyncStoreClient(node.address, curve=bad, timeout_s=1)
            try:
                await client.stats()
            finally:
                client.close()

        with pytest.raises(AuthenticationFailed):
            asyncio.run(refused())
    finally:
        node.stop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with StoreClient(dead, curve=good, timeout_s=0.5) as c:
        with pytest.raises(StoreUnavailable) as err:
            c.stats()
        assert not isinstance(err.value, AuthenticationFailed)


def test_connector_logs_authentication_failed_not_a_dead_node(keys, caplog):
    import torch

    from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
    from pagekv.store import ClientConfig, CurveClientKeys
    from tests.helpers import wait_until

    node = Node("--capacity", "8MiB", "--curve-secret-key", keys["server"][1], "--curve-allow",
                keys["allow"])  # fmt: skip
    geo = KVGeometry(2, 4, 2, 16, "bf16")
    bad = CurveClientKeys.from_files(keys["server"][0], keys["bad"][1])
    kv = [torch.zeros(2, 64, 2, 16, dtype=torch.bfloat16) for _ in range(2)]
    conn = KVConnector(geo, kv, ClientConfig((node.address,), timeout_s=1.0, curve=bad),
                       host_pages=8, namespace=KeyNamespace("auth", geo))  # fmt: skip
    try:
        with caplog.at_level("WARNING", logger="pagekv.connector"):
            assert conn.lookup(list(range(16))) == 0
            wait_until(lambda: any("authentication failed" in r.getMessage()
                                   for r in caplog.records), what="the diagnosis")  # fmt: skip
    finally:
        conn.close(timeout_s=1)
        node.stop()
