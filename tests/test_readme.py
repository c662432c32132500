"""The README's command blocks, run as written, so the README cannot drift from the product.

Every fenced block of README.md is a case of `test_readme_block`, in the README's order, run in
one shell session the way a new user pastes them: in a fresh copy of the work tree (a "clone"),
one block after another, each in `bash -euo pipefail` (so any failing command fails its block),
with the environment and directory a block leaves (`export`, `cd`) carried to the next. A
`python` block runs as a script in that session; a `toml` block must be a valid `warren-server
--config` file.

A block the test cannot run here says so in the README, in an HTML comment just before it:

    <!-- readme-test: skip: WHY -->   never run here; the case is skipped with that reason
    <!-- readme-test: docker -->      needs a Docker engine: skipped (saying so) when none answers;
                                      this test never starts one (test_docker_cluster.py does)
    <!-- readme-test: spark -->       the Spark job: marked `spark`, like tests/test_analysis.py

Unmarked blocks always run. Only what the shared machine needs is changed, never a command:

- ports: the README's local ports (clients 5691-5694, AMQP 5672-5675, peers 25691-25694, HTTP
  15672-15675; docker's host ports 5681-5686) are mapped to free ones, in the blocks' text and
  through the environment that `make cluster`/`make demo` (WARREN_CLIENT_BASE/WARREN_AMQP_BASE/
  WARREN_PEER_BASE/WARREN_HTTP_BASE) and docker-compose (WARREN_PORT_N1..3,
  WARREN_AMQP_PORT_N1..3) read;
  the docker image is tagged warren:readme-test, not warren:latest;
- `make` runs in a stand-in virtual environment (VIRTUAL_ENV: a folder whose bin/python runs
  this test's interpreter) and its install step is a no-op (PIP=true): `pip install -e` would
  re-point this environment's editable install at the temporary copy. PYTHONPATH points at the
  copy instead.

Afterwards every node the session started is stopped, and a docker-compose cluster taken down.
The unmarked blocks take about a minute on a busy 2-core machine (`make demo` is a third of it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
ANNOTATION = re.compile(r"^<!--\s*readme-test:\s*(?P<kind>[a-z]+)\s*(?::\s*(?P<reason>.*?))?\s*-->$")
KINDS = ("skip", "docker", "spark")
LANGS = ("sh", "python", "toml")
DOCKER_LOCK = Path("/tmp/warren-docker-cluster-test.lock")  # shared with test_docker_cluster.py


@dataclasses.dataclass
class Block:
    number: int
    line: int
    lang: str
    text: str
    kind: str = "run"
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.number:02d}-line{self.line}-{self.lang}-{self.kind}"


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with the readme-test annotation before each."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"README.md line {start + 1}: a code block that never closes")
        i += 1
        block = Block(len(blocks) + 1, start + 1, m.group(1), "\n".join(body) + "\n")
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        note = ANNOTATION.match(lines[j].strip()) if j >= 0 else None
        if note:
            block.kind, block.reason = note.group("kind"), note.group("reason") or ""
        blocks.append(block)
    return blocks


BLOCKS = readme_blocks(README.read_text())


def test_every_block_can_be_run_or_says_why_not():
    assert BLOCKS, "README.md has no code blocks"
    for b in BLOCKS:
        where = f"README.md line {b.line}"
        assert b.lang in LANGS, f"{where}: a ```{b.lang} block: the test runs sh, python and toml"
        assert b.kind in KINDS + ("run",), f"{where}: unknown readme-test kind {b.kind!r} (know {KINDS})"
        if b.kind == "skip":
            assert len(b.reason) > 10, f"{where}: a skipped block must say why"
        if b.lang == "python":
            compile(b.text, where, "exec")
        if b.lang == "sh":
            r = subprocess.run(["bash", "-n"], input=b.text, capture_output=True, text=True)
            assert r.returncode == 0, f"{where}: not valid shell: {r.stderr}"
    # the README's own promise: its cluster, mirroring and client blocks run, not just parse
    assert sum(b.kind == "run" and b.lang != "toml" for b in BLOCKS) >= 8


def test_the_pika_publisher_is_the_tutorials():
    """The README's pika publisher is RabbitMQ's tutorial as written (bar a comment naming the node)."""
    import tutorial_text

    shown = [re.sub(r"\s+# .*$", "", b.text, flags=re.M) for b in BLOCKS if b.lang == "python"]
    assert tutorial_text.publisher(5672) in shown


# --- the session ------------------------------------------------------------------------------

def _free_base(span: int = 4) -> int:
    """A base port B with B+1..B+span all free (for node i at B+i), below the ephemeral range: n4
    binds its ports minutes after the pick, and an outgoing connection must not have taken them."""
    from broker.localcluster import pick_free_ports

    return pick_free_ports(1, span)[0] - 1


def _copy_tree(dest: Path) -> None:
    """The work tree as a fresh clone would have it: tracked and new files, not ignored ones."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        for name in listed.stdout.decode().split("\0"):
            src = REPO / name
            if name and src.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
    else:  # not a git checkout
        shutil.copytree(REPO, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".cache", "var", "results", "__pycache__", "*.egg-info", "wheels", ".pytest_cache"))


def _docker_answers() -> bool:
    docker = shutil.which("docker")
    if docker is None or shutil.which("docker-compose") is None:
        return False
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


class Session:
    """One shell session over the README's blocks, in a copy of the work tree."""

    def __init__(self, root: Path):
        # its name is docker-compose's project name: unique, so that two runs do not share one
        self.clone = root / f"warren-readme-{os.getpid()}"
        self.clone.mkdir()
        _copy_tree(self.clone)
        self.state = root / "state"
        self.state.mkdir()
        self.log = root / "session.log"
        bin_dir = root / "bin"  # root is the stand-in virtual environment `make` uses
        bin_dir.mkdir()
        for name in ("python", "python3"):  # a script, not a symlink: a venv's python linked
            wrapper = bin_dir / name          # from elsewhere no longer finds its venv
            wrapper.write_text(f"#!/bin/sh\nexec {_quote(sys.executable)} \"$@\"\n")
            wrapper.chmod(0o755)
        client_base, peer_base, amqp_base = _free_base(), _free_base(), _free_base()
        http_base = _free_base()
        docker_ports = [_free_base(1) + 1 for _ in range(6)]
        self.ports = {5690 + i: client_base + i for i in range(1, 5)}
        self.ports.update({25690 + i: peer_base + i for i in range(1, 5)})
        self.ports.update({5671 + i: amqp_base + i for i in range(1, 5)})
        self.ports.update({15671 + i: http_base + i for i in range(1, 5)})
        self.ports.update({5680 + i: port for i, port in enumerate(docker_ports, 1)})
        env = {k: v for k, v in os.environ.items() if not k.startswith("WARREN_")}
        env.update(
            PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]),
            PYTHONPATH=str(self.clone), VIRTUAL_ENV=str(root), PIP="true", PYTHONUNBUFFERED="1",
            WARREN_CLIENT_BASE=str(client_base), WARREN_PEER_BASE=str(peer_base),
            WARREN_AMQP_BASE=str(amqp_base), WARREN_HTTP_BASE=str(http_base),
            WARREN_IMAGE="warren:readme-test",
            **{f"WARREN_PORT_N{i}": str(port) for i, port in enumerate(docker_ports[:3], 1)},
            **{f"WARREN_AMQP_PORT_N{i}": str(port) for i, port in enumerate(docker_ports[3:], 1)})
        (self.state / "env.sh").write_text("".join(f"export {k}={_quote(v)}\n" for k, v in env.items()))
        (self.state / "cwd").write_text(str(self.clone))
        self.env = env
        self.failed: Block | None = None
        self.docker_used = False

    def rewrite(self, text: str) -> str:
        return re.sub(r"\b(2569[1-4]|1567[2-5]|569[1-4]|568[1-6]|567[2-5])\b",
                      lambda m: str(self.ports[int(m.group(1))]), text)

    def run(self, block: Block, timeout: float) -> tuple[int, str]:
        """Run one block in the session; (exit code, its output)."""
        text = self.rewrite(block.text)
        if block.lang == "python":
            script = self.state / f"block{block.number:02d}.py"
            script.write_text(text)
            text = f"python {_quote(str(script))}\n"
        wrapper = (f"set -euo pipefail\nsource {_quote(str(self.state / 'env.sh'))}\n"
                   f"cd \"$(cat {_quote(str(self.state / 'cwd'))})\"\nset -x\n{text}\nset +x\n"
                   f"export -p > {_quote(str(self.state / 'env.sh'))}\npwd > {_quote(str(self.state / 'cwd'))}\n")
        out_path = self.state / f"block{block.number:02d}.out"
        with open(out_path, "wb") as out:  # a file, not a pipe: `cmd &` may outlive the block
            proc = subprocess.Popen(["bash", "-c", wrapper], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = -1
        output = out_path.read_text(errors="replace")
        with open(self.log, "a") as log:
            log.write(f"===== block {block.number} (README.md line {block.line}), exit {code}\n{output}\n")
        if code == -1:
            output += f"\n(the block did not finish within {timeout:.0f} s)"
        return code, output

    def close(self) -> None:
        from broker.localcluster import stop

        for home in {self.clone / "var" / "warren", Path(_exported(self.state, "WARREN_HOME") or self.clone)}:
            if (home / "pids.json").exists() or (home / "run").is_dir():
                stop(home, timeout=15)
        if self.docker_used:
            subprocess.run(["docker-compose", "down", "--remove-orphans", "-t", "5"], cwd=self.clone,
                           env=self.env, capture_output=True, timeout=180)


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _exported(state: Path, name: str) -> str | None:
    m = re.search(rf"^declare -x {name}=\"(.*)\"$", (state / "env.sh").read_text(), re.M)
    return m.group(1) if m else None


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    s = Session(tmp_path_factory.mktemp("readme"))
    yield s
    s.close()


TIMEOUTS = {"docker": 900.0, "spark": 300.0}


def _params():
    for b in BLOCKS:
        marks = [pytest.mark.timeout(TIMEOUTS.get(b.kind, 240.0) + 30)]
        if b.kind == "spark":
            marks.append(pytest.mark.spark)
        if b.kind == "docker":
            marks.append(pytest.mark.docker)
        if b.lang != "toml":
            marks.append(pytest.mark.process)
        yield pytest.param(b, id=b.id, marks=marks)


@pytest.mark.parametrize("block", list(_params()))
def test_readme_block(block: Block, session: Session, request):
    if block.kind == "skip":
        pytest.skip(f"README.md line {block.line}: {block.reason}")
    if block.lang == "toml":
        from broker.config import _read_toml

        path = session.state / f"block{block.number:02d}.toml"
        path.write_text(block.text)
        _read_toml(str(path))  # raises ConfigError naming the key
        return
    if session.failed is not None:
        pytest.skip(f"block {session.failed.number} (README.md line {session.failed.line}) failed; "
                    "the blocks after it run in its wake")
    if block.kind == "spark":
        pytest.importorskip("pyspark", reason="pyspark is not installed")
        if shutil.which("java") is None:
            pytest.skip("Spark needs Java on PATH")
    if block.kind == "docker":
        if not _docker_answers():
            pytest.skip("no Docker engine answers (this test does not start one; "
                        "tests/test_docker_cluster.py and `make docker-engine` do)")
        session.docker_used = True
        import fcntl

        with DOCKER_LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            code, output = session.run(block, TIMEOUTS["docker"])
    else:
        code, output = session.run(block, TIMEOUTS.get(block.kind, 240.0))
    if code != 0:
        session.failed = block
    assert code == 0, (f"README.md line {block.line}: the block failed (exit {code}); "
                       f"its commands and output:\n{output[-6000:]}")
    _check_effects(block, session, output)


def _check_effects(block: Block, session: Session, output: str) -> None:
    """What some blocks must have done beyond exiting 0."""
    text = block.text
    home = session.clone / "var" / "warren"
    if "make demo" in text:
        assert "published 10,000 x 1 KiB to demo.orders" in output
        assert "== stopping the cluster" in output and "longest pause in deliveries" in output
    if "make cluster" in text:
        assert "Running nodes: n1, n2, n3" in output
        assert not (home / "cookie").exists(), "a stray cookie"
    if "kill -9 \"$(" in text:  # the tour's promotion: n2 leads the queue, with every message
        assert re.search(r"^tour\.orders\tn2\t<n2\.[^\n]*\t10000$", output, re.M), "no promotion to n2"
    if "sync_queue tour.orders" in text:
        assert "sync completed: 10,000 messages" in output
    if "basic_get('tour.greetings'" in text:
        assert "b'Hello'" in output
    if "wait_for_confirms" in text:
        assert "all confirmed: True" in output
    if "make stop" in text:
        from broker.localcluster import running_pids

        assert running_pids(home) == {}, "make stop left nodes running"
        assert "n1: stopped" in output and "n3: stopped" in output
    if "make clean" in text:
        assert not (home / "data").exists() and not (home / "pids.json").exists(), \
            "make clean left the cluster's state"
