"""The process-test layer over broker.localcluster: real `warren-server` processes on 127.0.0.1
on free ports, in a temporary WARREN_HOME, with a test secret. Plain synchronous Python, so
process tests need no event loop.

    @pytest.fixture(scope="module")
    def cluster(request, tmp_path_factory):
        with running_cluster(request, tmp_path_factory, 3) as c:   # n1..n3, joined to n1
            yield c

    with ProcessCluster(3, net_ticktime=5) as c:       # the same without pytest
        ...

A `ProcessCluster` (a `broker.localcluster.LocalCluster`) offers:

- `names`, `ports[name] -> (client, peer)`, `client_port(name)`, `peer_port(name)`,
  `client_addr(name)` ("127.0.0.1:PORT"), `all_client_addrs()`, `env` (WARREN_HOME, WARREN_SECRET),
  `home`, `tmp`, `procs[name]` (the Popen), `alive(name)`, `log_path(name)`, `dump_logs()`;
- `ctl(name, *args, timeout=30, env=None)` -> CompletedProcess of `warrenctl -n name args`,
  `ctl_ok(name, *args)` -> stdout or RuntimeError, `ctl_json(name, *args)` (the command line
  itself, for tests of it); `call(name, command, {args})` -> the value, the same command sent
  from the test's own process (ControlError when refused), and on it `cluster_status(name)`,
  `wait_status(name)`, `wait_running(on, {names}, timeout)`;
- `kill9(name)`, `sigstop(name)`, `sigcont(name)`, `sigterm(name, wait=True)` -> exit code,
  `signal(name, sig)`, `restart(name, wait=True, extra_args=())` (same ports and home),
  `spawn(name, extra_args)` (start one node without waiting);
- `start()`, `stop(kill=False)`, `cleanup()` (stop and remove the temporary directory).

`server_args=[...]` passes extra flags to every `warren-server`; `http=True` gives every node a
management HTTP port on a free port (`http_ports[name]`); `tls=DIR` (certificates as
`python -m broker.tls certs DIR` writes them) turns TLS on: `amqps_port(name)`,
`client_ssl_context()`. `wait_no_consumers(ch, queue)`
waits until a queue has no consumer (through a blocking channel of pika or of warren's client);
`publish(cluster, node, queue, n)` declares a durable queue on a node and publishes n numbered
messages to it with confirms; `wait_until(pred, timeout, what)` polls until pred() is true and
returns its value.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

import trio

from broker.client.aio import open_connection
from broker.localcluster import LocalCluster, free_port  # noqa: F401  (free_port: for tests)

SECRET = "process-test-secret"


class ProcessCluster(LocalCluster):
    def __init__(self, n: int = 3, net_ticktime: float = 5.0, tmpdir: str | None = None,
                 server_args: list[str] | tuple[str, ...] = (), http: bool = False, tls=None):
        self._own_tmp = tmpdir is None
        self.tmp = Path(tmpdir or tempfile.mkdtemp(prefix="warren-proc-"))
        super().__init__(self.tmp / "home", n, free_ports=True, net_ticktime=net_ticktime,
                         secret=SECRET, server_args=server_args, http=http, tls=tls)
        self.home.mkdir(parents=True, exist_ok=True)

    def cleanup(self) -> None:
        self.stop(kill=True)
        if self._own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def running_cluster(request, tmp_path_factory, n: int = 3, net_ticktime: float = 5.0,
                    server_args: list[str] | tuple[str, ...] = (), http: bool = False, tls=None):
    """A started ProcessCluster in a pytest temporary directory, killed afterwards; the nodes'
    logs are printed when a test that used it failed."""
    failed_before = request.session.testsfailed
    tmp = tmp_path_factory.mktemp(f"cluster-{request.node.name}"[:60])
    with ProcessCluster(n, net_ticktime=net_ticktime, tmpdir=str(tmp), server_args=server_args,
                        http=http, tls=tls) as c:
        yield c
        if request.session.testsfailed > failed_before:
            c.dump_logs()


def wait_no_consumers(ch, queue: str, timeout: float = 5.0) -> None:
    """Until `queue` has no consumer (those of a connection that just closed go with it), through
    a blocking channel of pika or of warren's client; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (n := ch.queue_declare(queue, passive=True).method.consumer_count) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert n == 0, f"{n} consumer(s) of a closed connection still on queue {queue!r} after {timeout:g} s"


def publish(cluster, node: str, queue: str, n: int, size: int = 1024) -> None:
    """Declare durable `queue` through `node` and publish n messages of `size` bytes to it (the
    first 8 bytes number them), with confirms: all confirmed, or AssertionError."""
    async def run():
        async with open_connection([cluster.client_addr(node)]) as conn:
            ch = await conn.channel()
            await ch.queue_declare(queue, durable=True)
            await ch.confirm_delivery()
            for i in range(n):
                await ch.basic_publish("", queue, i.to_bytes(8, "big") + b"." * (size - 8))
            assert await ch.wait_for_confirms(timeout=60)
    trio.run(run)


def wait_until(pred, timeout: float = 30.0, what: str = "condition"):
    """pred()'s first true value, polled every 0.1 s; AssertionError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
