"""The installed `pagekv` console script: version, help, settings from flags/env/TOML, every bad
input (message and exit status), stats/ping output, keygen, log format. Loopback, free ports."""

import json
import os
import re
import socket
import stat
import subprocess
import sys

import pytest
import zmq.auth

import pagekv
from pagekv.store import NodeConfig, StoreClient
from pagekv.store.cli.serve import check_node
from pagekv.store.cli.settings import Setting, format_size, memory_limit, resolve
from pagekv.store.node.auth import write_keypair
from tests.cli_helpers import Node, run_cli

pytestmark = pytest.mark.slow


def dead_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_version_from_script_and_python_m():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"pagekv {pagekv.__version__}"
    mod = subprocess.run([sys.executable, "-m", "pagekv", "--version"], capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert mod.returncode == 0 and mod.stdout == out.stdout


def test_help_shows_defaults_units_and_env():
    serve = run_cli("serve", "--help").stdout
    cap = NodeConfig().capacity
    assert f"{format_size(cap)} = {cap:,} bytes; env PAGEKV_CAPACITY" in re.sub(r"\s+", " ", serve)
    assert "KiB/MiB/GiB/TiB = 1024^n" in serve and "KB/MB/GB/TB = 1000^n" in serve
    assert "'*' to allow any client key" in serve
    cluster = run_cli("cluster", "--help").stdout
    for flag in ("--curve-secret-key", "--curve-allow", "--nodes", "--max-restarts", "--config"):
        assert flag in cluster


TOO_MUCH = str(memory_limit() * 2)
BAD_INPUTS = [
    (["serve", "--capacity", "10"], {}, "below the 1 MiB minimum", 2),
    (["serve", "--capacity", "lots"], {}, "--capacity: not a size: 'lots'", 2),
    (["serve", "--capacity", TOO_MUCH], {}, "more than this machine's memory", 2),
    (["serve", "--max-message-size", "1MiB"], {},
     "--max-block-size (33554432) must be <= max_message_size (1048576)", 2),
    (["serve", "--endpoint", "nowhere"], {}, "not an endpoint: 'nowhere'", 2),
    (["serve", "--port", "70000"], {}, "--port must be in [0, 65536)", 2),
    (["serve", "--curve-secret-key", "x.key_secret"], {}, "go together", 2),
    (["serve", "--log-level", "loud"], {}, "--log-level 'loud'", 2),
    (["serve"], {"PAGEKV_CAPACITY": "lots"}, "$PAGEKV_CAPACITY: not a size", 2),
    (["serve"], {"PAGEKV_VERIFY_PUTS": "maybe"}, "$PAGEKV_VERIFY_PUTS: not a boolean", 2),
    (["cluster", "--nodes", "0"], {}, "--nodes must be >= 1", 2),
    (["cluster", "--nodes", "2", "--capacity", str(memory_limit() // 2 + (1 << 20))], {},
     "2 nodes x", 2),
    (["cluster", "--base-port", "65535", "--nodes", "3"], {}, "--base-port 65535 + 3 nodes", 2),
    (["stats", "localhost"], {}, "not an endpoint: 'localhost' (host:port", 2),
    (["ping", "tcp://127.0.0.1:99999"], {}, "not an endpoint: 'tcp://127.0.0.1:99999'", 2),
    (["ping", "--count", "0", "tcp://127.0.0.1:1"], {}, "--count must be >= 1", 2),
    (["keygen", "keys", "a/b"], {}, "no path separators", 2),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "env", "message", "code"),
    BAD_INPUTS,
    ids=[" ".join(a[:3]) + str(sorted(e)) for a, e, _, _ in BAD_INPUTS],
)
def test_bad_input_is_a_message_and_an_exit_status(args, env, message, code, tmp_path):
    if args[0] == "serve":
        args = [*args, "--port", "0"] if "--port" not in args else args
    out = run_cli(*args, env=env, timeout=30)
    assert out.returncode == code, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_capacity_over_memory_starts_with_force():
    node = Node("--capacity", TOO_MUCH, "--force")
    try:
        with StoreClient(node.address, timeout_s=5) as client:
            assert client.stats()[0]["capacity"] == int(TOO_MUCH)
    finally:
        assert node.stop() == 0


def test_config_file_env_and_flags_in_that_order(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text('capacity = "48MiB"\nmax-block-size = "1MiB"\nlog_level = "warning"\n')
    env = {"PAGEKV_CAPACITY": "40MiB"}
    by_env = Node("--config", toml, env=env)
    by_flag = Node("--config", toml, "--capacity", "32MiB", env=env)
    try:
        with StoreClient([by_env.address, by_flag.address], timeout_s=5) as client:
            env_stats, flag_stats = client.stats()
        assert env_stats["capacity"] == 40 << 20 and flag_stats["capacity"] == 32 << 20
        with StoreClient(by_env.address, timeout_s=5) as client:  # max-block-size from the file
            assert client.put_many([b"k" * 16], [os.urandom((1 << 20) + 1)])[0].name == "TOO_LARGE"
    finally:
        assert by_env.stop() == 0 and by_flag.stop() == 0
    assert " INFO " not in by_env.log  # log_level = "warning" from the file


def test_config_file_errors(tmp_path):
    bad_key = tmp_path / "a.toml"
    bad_key.write_text('capcity = "4GiB"\n')
    out = run_cli("serve", "--port", "0", "--config", bad_key)
    assert out.returncode == 2 and "unknown setting(s) capcity" in out.stderr
    bad_toml = tmp_path / "b.toml"
    bad_toml.write_text("capacity = \n")
    out = run_cli("serve", "--port", "0", "--config", bad_toml)
    assert out.returncode == 2 and "not valid TOML" in out.stderr
    out = run_cli("serve", "--port", "0", env={"PAGEKV_CONFIG": str(tmp_path / "none.toml")})
    assert out.returncode == 2 and "none.toml: No such file" in out.stderr


def test_settings_precedence_and_sizes(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('a = "1GB"\nb = "2G"\nc = 7\n')
    settings = [Setting(n, "1KiB", "", "size") for n in "abcd"]
    ns = type("Args", (), {"a": "4GiB", "b": None, "c": None, "d": None})()
    values = resolve(ns, settings, str(toml), environ={"PAGEKV_B": "3GB", "PAGEKV_D": "5k"})
    assert values == {"a": 4 << 30, "b": 3 * 10**9, "c": 7, "d": 5 << 10}
    assert resolve(ns, settings, str(toml), environ={})["b"] == 2 << 30


def test_non_loopback_without_curve_warns_and_loopback_does_not():
    def warns(**kw):
        return any("beyond loopback" in w for w in check_node(NodeConfig(**kw), force=False))

    assert warns(host="0.0.0.0") and warns(host="*") and warns(host="10.1.2.3")
    assert not warns(host="127.0.0.1") and not warns(host="::1") and not warns(host="localhost")
    assert not warns(endpoint="ipc:///tmp/pagekv-test.sock")


def test_log_lines_have_level_and_logger_name_and_defaults_warn_of_nothing():
    node = Node("--capacity", "64MiB")
    assert node.stop() == 0
    assert not [line for line in node.lines if " WARNING " in line], node.lines
    lines = [line for line in node.lines if not line.startswith("pagekv node ready")]
    assert lines and all(
        re.match(r"\d{4}-\d\d-\d\d [\d:,]+ (DEBUG|INFO|WARNING|ERROR) pagekv\.[\w.]+: ", line)
        for line in lines
    ), lines


def test_stats_table_json_and_ping():
    node, dead = Node("--capacity", "16MiB"), dead_endpoint()
    try:
        with StoreClient(node.address, timeout_s=5) as client:
            client.put_many([os.urandom(16) for _ in range(3)], [os.urandom(1 << 20)] * 3)
            truth = client.stats()[0]
        table = run_cli("stats", node.address, dead, "--timeout", "3")
        assert table.returncode == 1, table.stderr
        header, row, dead_row = table.stdout.splitlines()
        assert header.split()[:4] == ["node", "blocks", "bytes", "capacity"]
        assert row.split()[:4] == [node.address, "3", format_size(truth["bytes"]), "16MiB"]
        assert dead_row.split()[0] == dead and "unreachable" in dead_row
        doc = json.loads(run_cli("stats", "--json", node.address, dead, "--timeout", "3").stdout)
        ok, down = doc["nodes"]
        assert ok["ok"] and ok["stats"]["blocks"] == 3 and ok["stats"]["bytes"] == truth["bytes"]
        assert not down["ok"] and down["error"] == "unreachable" and down["endpoint"] == dead
        bare = node.address.removeprefix("tcp://")  # host:port, as operators type it
        ping = run_cli("ping", bare)
        assert ping.returncode == 0 and re.fullmatch(
            rf"{re.escape(node.address)} ok [\d.]+ ms \(median of 3; .*\)\n", ping.stdout
        ), ping.stdout
        table = run_cli("stats", bare, "--timeout", "3")
        assert table.returncode == 0 and table.stdout.splitlines()[1].split()[:2] == [
            node.address,
            "3",
        ]
        ping = run_cli("ping", "--count", "1", dead, "--timeout", "3")
        assert ping.returncode == 1 and ping.stdout.startswith(f"{dead} unreachable")
    finally:
        assert node.stop() == 0


def test_stats_and_ping_with_partial_curve_options(tmp_path):
    public, secret = write_keypair(str(tmp_path), "client")
    for cmd in ("stats", "ping"):
        out = run_cli(cmd, "tcp://127.0.0.1:1", "--curve-server-cert", public)
        assert out.returncode == 2 and "needs --curve-client-cert" in out.stderr, out.stderr
        out = run_cli(cmd, "tcp://127.0.0.1:1", "--curve-client-cert", secret)
        assert out.returncode == 2 and "needs --curve-server-cert" in out.stderr
        out = run_cli(cmd, "tcp://127.0.0.1:1", "--curve-server-cert", public,
                      "--curve-client-cert", public)  # fmt: skip
        assert out.returncode == 2 and "has no secret key" in out.stderr
        out = run_cli(cmd, "tcp://127.0.0.1:1", "--curve-server-cert", tmp_path / "none.key",
                      "--curve-client-cert", secret)  # fmt: skip
        assert out.returncode == 2 and "No such file" in out.stderr
        assert "Traceback" not in out.stderr


def test_keygen_modes_no_overwrite_and_force(tmp_path):
    keys = tmp_path / "keys"
    out = run_cli("keygen", keys, "node1")
    assert out.returncode == 0, out.stderr
    public, secret = keys / "node1.key", keys / "node1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not stat.S_IMODE(public.stat().st_mode) & 0o022  # nobody else can change it
    pub_key, sec_key = zmq.auth.load_certificate(str(secret))
    assert sec_key is not None and zmq.auth.load_certificate(str(public)) == (pub_key, None)
    before = (public.read_bytes(), secret.read_bytes())
    again = run_cli("keygen", keys, "node1")
    assert again.returncode == 1 and "--force" in again.stderr
    assert (public.read_bytes(), secret.read_bytes()) == before
    forced = run_cli("keygen", keys, "node1", "--force")
    assert forced.returncode == 0
    new_key = zmq.auth.load_certificate(str(secret))[0]
    assert new_key != pub_key and zmq.auth.load_certificate(str(public))[0] == new_key
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    for name in ("../evil", "a/b", "..", ""):
        out = run_cli("keygen", keys, name)
        assert out.returncode == 2 and "plain file name" in out.stderr, (name, out.stderr)
    assert sorted(p.name for p in keys.iterdir()) == ["node1.key", "node1.key_secret"]
