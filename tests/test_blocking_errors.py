"""The blocking client's refusals read as errors, not crashes: a queue redeclared with another
`durable` (RabbitMQ's tutorial declares `hello` non-durable) raises ChannelClosedByBroker with
the broker's code and text, its traceback the application's own calls and none of trio's thread
hop; so do a node that cannot be reached and a call on a closed connection."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import traceback

import pytest

import broker.client as pika
from broker.localcluster import free_port
from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def one(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 1) as c:
        yield c


def _shown(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def test_an_inequivalent_durable_is_a_406_with_the_brokers_words(one):
    params = pika.ConnectionParameters("localhost", one.client_port("n1"))
    with pika.BlockingConnection(params) as connection:
        channel = connection.channel()
        channel.queue_declare(queue="tutorial.hello")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
            channel.queue_declare(queue="tutorial.hello", durable=True)
        assert caught.value.reply_code == 406
        assert "inequivalent arg 'durable'" in caught.value.reply_text
        shown = _shown(caught.value)
        assert "trio" not in shown and "outcome" not in shown and "aio.py" not in shown, shown
        assert "During handling" not in shown and "direct cause" not in shown, shown
        with pytest.raises(pika.exceptions.AMQPError):  # the channel is closed now
            channel.queue_declare(queue="tutorial.hello")
    with pytest.raises(pika.AMQPConnectionError, match="the connection is closed") as caught:
        connection.channel()
    assert "trio" not in _shown(caught.value)


def test_a_node_that_cannot_be_reached_is_one_error(tmp_path):
    with pytest.raises(pika.AMQPConnectionError, match="could not connect") as caught:
        pika.BlockingConnection(pika.ConnectionParameters("localhost", free_port()))
    assert "trio" not in _shown(caught.value)


def test_the_uncaught_406_prints_a_short_traceback_of_the_program_s_own_lines(one, tmp_path):
    """What a user sees when the tutorial's queue is declared again with durable=True."""
    script = tmp_path / "declare.py"
    script.write_text(textwrap.dedent(f"""\
        import broker.client as pika
        connection = pika.BlockingConnection(pika.ConnectionParameters('localhost', {one.client_port('n1')}))
        channel = connection.channel()
        channel.queue_declare(queue='script.hello')
        channel.queue_declare(queue='script.hello', durable=True)
        """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(
        "broker.client.errors.ChannelClosedByBroker: (406) inequivalent arg 'durable'"), r.stderr
    assert "trio" not in r.stderr and len(r.stderr.splitlines()) <= 12, r.stderr
