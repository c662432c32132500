"""TLS in one process: broker/tls.py's contexts and certificates, TcpNetwork's TLS listeners and
dials, framed.py's readers and writers over a TLS stream (the stream's own methods) beside the
direct socket path of plain streams, and the TLS settings as flags, WARREN_* variables and TOML."""

from __future__ import annotations

import socket
import ssl

import pytest
import trio

from broker import config
from broker.config import ConfigError
from broker.framed import FramedStream, Outbox, Reader, direct_socket
from broker.network import SimNetwork, TcpNetwork
from broker.server import parse_args
from broker.tls import TlsError, client_context, make_ca, make_cert, make_certs, node_contexts, server_context
from wire import messages as m


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, nodes=1)
    ca = make_ca(d / "other", "another CA")
    make_cert(d / "other", "stranger", ca, ["127.0.0.1"])
    make_cert(d, "expired", _load_ca(d), ["127.0.0.1"], expired=True)
    return d


def _load_ca(d):
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    return (x509.load_pem_x509_certificate((d / "ca.pem").read_bytes()),
            load_pem_private_key((d / "ca.key").read_bytes(), None))


def _server(certs, verify=True, required=True) -> ssl.SSLContext:
    return server_context(str(certs / "n1.pem"), str(certs / "n1.key"), str(certs / "ca.pem"), verify, required)


def _client(certs, stem="client", where=None) -> ssl.SSLContext:
    where = where or certs
    return client_context(str(where / f"{stem}.pem"), str(where / f"{stem}.key"), str(certs / "ca.pem"))


async def _echo_frames(stream, peer) -> None:
    framed = FramedStream(stream)
    outbox = Outbox(framed)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.run)
        while msgs := await framed.receive_batch():
            for msg in msgs:
                outbox.put(msg)
        outbox.close()


async def _round_trip(server_ctx, client_ctx, count=200, size=70_000) -> list:
    """`count` publishes of `size` bytes sent to a framed echo server over TLS and read back."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(lambda task_status: TcpNetwork().serve(
            "127.0.0.1", 0, _echo_frames, tls=server_ctx, task_status=task_status))
        stream = await TcpNetwork(dial_tls=client_ctx).connect("127.0.0.1", port)
        async with stream:
            framed = FramedStream(stream)
            sent = [m.Publish(1, "q", [bytes([i % 256]) * size], None) for i in range(count)]
            await framed.send_now(*sent)
            got = []
            while len(got) < count:
                got += await framed.receive_batch()
        nursery.cancel_scope.cancel()
    return got


def _refused(server_ctx, client_ctx) -> str:
    """Why a client was refused ("" if it got through)."""
    why = ""
    try:
        trio.run(_round_trip, server_ctx, client_ctx, 1, 10)
    except* (OSError, trio.BrokenResourceError) as group:
        why = " ".join(f"{e} {e.__cause__ or ''}" for e in group.exceptions).strip() or "refused"
    return why


def test_framed_messages_cross_a_tls_link_both_ways(certs):
    got = trio.run(_round_trip, _server(certs), _client(certs))
    assert [bytes(g.bodies[0][:1]) for g in got] == [bytes([i % 256]) for i in range(200)]
    assert all(len(g.bodies[0]) == 70_000 for g in got)


def test_plain_streams_keep_the_direct_socket_path_and_tls_streams_use_their_own_methods(certs):
    """The one check per connection: a plain SocketStream is read and written on its socket
    (Reader, DirectWrites), an SSLStream over the same kind of socket through its methods."""
    async def main():
        a, b = socket.socketpair()
        plain = trio.SocketStream(trio.socket.from_stdlib_socket(a))
        secured = trio.SSLStream(plain, _client(certs), server_hostname="localhost")
        assert direct_socket(plain) is not None and Reader(plain)._sock is not None
        assert direct_socket(secured) is None and Reader(secured)._sock is None
        assert Outbox(FramedStream(secured))._direct.sock is None
        b.close()
        await plain.aclose()
    trio.run(main)


@pytest.mark.parametrize("stem, where, reason, alert", [
    (None, None, "no certificate", "certificate required"),
    ("stranger", "other", "a certificate of another CA", "unknown ca"),
    ("expired", None, "an expired certificate", "certificate expired"),
])
def test_a_listener_that_requires_a_certificate_refuses_a_bad_one(certs, stem, where, reason, alert):
    if stem is None:
        ctx = client_context(ca=str(certs / "ca.pem"))
    else:
        ctx = _client(certs, stem, certs / where if where else None)
    # TLS 1.3: the server checks the client's certificate after the client's handshake is over,
    # so the client meets the refusal at its handshake or at its first read, as a closed link
    why = _refused(_server(certs), ctx)
    assert why, f"a client with {reason} was let in"
    assert alert in why.lower().replace("_", " "), f"the client was not told why: {why}"


def test_verify_peer_without_fail_if_no_peer_cert_lets_a_client_without_one_in(certs):
    got = trio.run(_round_trip, _server(certs, required=False), client_context(ca=str(certs / "ca.pem")), 3, 10)
    assert len(got) == 3


def test_a_client_refuses_a_server_of_another_ca(certs):
    other = server_context(str(certs / "other" / "stranger.pem"), str(certs / "other" / "stranger.key"),
                           "", False, False)
    assert "unable to get local issuer certificate" in _refused(other, _client(certs))


def test_the_simulated_network_refuses_tls_rather_than_ignore_it():
    async def main():
        await SimNetwork().host("a").serve("a", 1, _echo_frames, tls=ssl.create_default_context())
    with pytest.raises(ValueError, match="no TLS"):
        trio.run(main)


# --- settings -------------------------------------------------------------------------------------

def test_tls_settings_from_flags_environment_and_toml(tmp_path, certs):
    flags = parse_args(["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem",
                        "--tls-verify-peer", "--tls-fail-if-no-peer-cert", "--amqps-port", "5999"])
    cfg = config.load(flags, {"WARREN_SECRET": "s"})
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.tls_verify_peer, cfg.tls_fail_if_no_peer_cert,
            cfg.amqps_port) == ("c.pem", "k.pem", "ca.pem", True, True, 5999)
    env = {"WARREN_SECRET": "s", "WARREN_TLS_CERT": "e.pem", "WARREN_TLS_CA": "eca.pem",
           "WARREN_TLS_VERIFY_PEER": "true", "WARREN_TLS_FAIL_IF_NO_PEER_CERT": "no"}
    cfg = config.load(parse_args([]), env)
    assert (cfg.tls_cert, cfg.tls_ca, cfg.tls_verify_peer, cfg.tls_fail_if_no_peer_cert) == ("e.pem", "eca.pem", True, False)
    cfg = config.load(parse_args(["--no-tls-verify-peer"]), env)
    assert cfg.tls_verify_peer is False  # a flag beats the environment
    toml = tmp_path / "node.toml"
    toml.write_text('tls_cert = "t.pem"\ntls_ca = "tca.pem"\ntls_verify_peer = true\namqps_port = 6001\n')
    cfg = config.load({"config": str(toml)}, {"WARREN_SECRET": "s"})
    assert (cfg.tls_cert, cfg.tls_ca, cfg.tls_verify_peer, cfg.amqps_port) == ("t.pem", "tca.pem", True, 6001)
    assert config.load(parse_args([]), {"WARREN_SECRET": "s"}).tls_cert == ""  # off by default


@pytest.mark.parametrize("env, message", [
    ({"WARREN_TLS_VERIFY_PEER": "maybe"}, "is not a boolean"),
    ({"WARREN_TLS_CERT": "c.pem"}, "tls_cert needs tls_ca"),
    ({"WARREN_TLS_CA": "ca.pem"}, "need tls_cert"),
])
def test_bad_tls_settings_are_clear_errors(env, message):
    with pytest.raises(ConfigError, match=message):
        config.load(parse_args([]), {"WARREN_SECRET": "s", **env})


def test_a_toml_boolean_must_be_a_boolean(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text('tls_verify_peer = "yes"\n')
    with pytest.raises(ConfigError, match="tls_verify_peer must be a boolean"):
        config.load({"config": str(toml)}, {"WARREN_SECRET": "s"})


def test_node_contexts_name_a_missing_file(tmp_path, certs):
    cfg = config.load(parse_args(["--tls-cert", str(tmp_path / "nope.pem"), "--tls-ca", str(certs / "ca.pem")]),
                      {"WARREN_SECRET": "s"})
    with pytest.raises(TlsError, match="nope.pem"):
        node_contexts(cfg)
    cfg = config.load(parse_args(["--tls-cert", str(certs / "n1.pem"), "--tls-key", str(certs / "n1.key"),
                                  "--tls-ca", str(certs / "ca.pem"), "--tls-verify-peer"]), {"WARREN_SECRET": "s"})
    contexts = node_contexts(cfg)
    assert contexts.peer_server.verify_mode == ssl.CERT_REQUIRED  # the peer port: always mutual
    assert contexts.clients.verify_mode == ssl.CERT_OPTIONAL


def test_the_compose_override_gives_each_node_its_own_certificate_and_an_amqps_port():
    import yaml
    from pathlib import Path
    override = yaml.safe_load((Path(__file__).resolve().parents[1] / "docker-compose.tls.yml").read_text())
    for name in ("n1", "n2", "n3"):
        node = override["services"][name]
        assert "./var/certs:/certs:ro" in node["volumes"]
        env = node["environment"]
        assert (env["WARREN_TLS_CERT"], env["WARREN_TLS_KEY"], env["WARREN_TLS_CA"]) == (
            f"/certs/{name}.pem", f"/certs/{name}.key", "/certs/ca.pem")
        assert env["WARREN_AMQPS_PORT"] == "5671" and node["ports"][0].endswith(":5671")


def test_make_certs_names_each_node_for_compose_and_localhost(tmp_path):
    from cryptography import x509
    make_certs(tmp_path, nodes=2, hosts=["broker.example"])
    cert = x509.load_pem_x509_certificate((tmp_path / "n2.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"n2", "localhost", "broker.example"} <= set(names.get_values_for_type(x509.DNSName))
    assert (tmp_path / "n2.key").stat().st_mode & 0o077 == 0  # the keys: the owner's only
    assert {p.name for p in tmp_path.iterdir()} == {"ca.pem", "ca.key", "n1.pem", "n1.key", "n2.pem",
                                                    "n2.key", "client.pem", "client.key"}


def test_refused_handshakes_are_logged_once_per_reason(certs):
    class Log:
        lines: list = []

        def warning(self, event, **fields):
            self.lines.append((event, fields["reason"]))

    log = Log()

    async def main():
        network = TcpNetwork(log=log)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(lambda task_status: network.serve(
                "127.0.0.1", 0, _echo_frames, tls=_server(certs), task_status=task_status))
            for _ in range(3):
                for context in (client_context(ca=str(certs / "ca.pem")), _client(certs, "expired")):
                    try:
                        stream = await TcpNetwork(dial_tls=context).connect("127.0.0.1", port)
                        await stream.receive_some(10)
                    except (OSError, trio.BrokenResourceError):
                        pass
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sorted(log.lines) == [("TLS handshake refused", "PEER_DID_NOT_RETURN_A_CERTIFICATE"),
                                 ("TLS handshake refused", "certificate has expired")], log.lines
