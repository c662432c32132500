#!/bin/sh
# Make sure a Docker engine is answering on this machine, for the warren
# compose cluster.  Meant for a root shell on a Debian host without systemd:
#   - installs docker.io, docker-compose and debootstrap with apt-get when
#     dockerd, docker-compose or debootstrap is missing;
#   - starts dockerd in the background unless `docker info` already works;
#   - waits (bounded) until `docker info` answers.
# dockerd keeps its own pid in $WARREN_DOCKERD_PID and logs to $WARREN_DOCKERD_LOG.
#
#   sh docker/engine.sh stop   stops the dockerd this script started (the pid in
#                              $WARREN_DOCKERD_PID), and nothing else.
set -eu

PIDFILE=${WARREN_DOCKERD_PID:-/run/warren-dockerd.pid}
LOGFILE=${WARREN_DOCKERD_LOG:-/tmp/warren-dockerd.log}
WAIT_SECONDS=${WARREN_DOCKERD_WAIT:-60}

if [ "$(id -u)" != 0 ]; then
    echo "engine.sh: must run as root (it installs packages and starts dockerd)" >&2
    exit 1
fi

if [ "${1:-}" = stop ]; then
    if [ ! -s "$PIDFILE" ] || ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
        echo "engine.sh: no dockerd started by this script is running (no live pid in $PIDFILE)"
        exit 0
    fi
    pid=$(cat "$PIDFILE")
    echo "engine.sh: stopping dockerd (pid $pid)"
    kill -TERM "$pid"
    i=0
    while kill -0 "$pid" 2>/dev/null && [ "$i" -lt 60 ]; do
        i=$((i + 1))
        sleep 0.5
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "engine.sh: dockerd (pid $pid) is still running after 30 s" >&2
        exit 1
    fi
    rm -f "$PIDFILE"
    exit 0
elif [ -n "${1:-}" ]; then
    echo "engine.sh: unknown argument '$1' (none starts the engine; 'stop' stops it)" >&2
    exit 2
fi

missing=""
command -v dockerd >/dev/null 2>&1 || missing="$missing docker.io"
command -v docker-compose >/dev/null 2>&1 || missing="$missing docker-compose"
command -v debootstrap >/dev/null 2>&1 || missing="$missing debootstrap"
if [ -n "$missing" ]; then
    echo "engine.sh: installing:$missing"
    apt-get update
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
fi

if docker info >/dev/null 2>&1; then
    echo "engine.sh: a Docker engine is already answering"
    exit 0
fi

running_pid=""
if [ -s "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    running_pid=$(cat "$PIDFILE")
    echo "engine.sh: dockerd (pid $running_pid) is starting, waiting for it"
else
    rm -f "$PIDFILE"
    echo "engine.sh: starting dockerd, log in $LOGFILE"
    # setsid: the daemon must not die with the shell (or make) that started it.
    setsid dockerd --pidfile "$PIDFILE" </dev/null >>"$LOGFILE" 2>&1 &
fi

i=0
while [ "$i" -lt "$WAIT_SECONDS" ]; do
    if docker info >/dev/null 2>&1; then
        echo "engine.sh: Docker engine is up (dockerd pid $(cat "$PIDFILE" 2>/dev/null || echo '?'))"
        exit 0
    fi
    i=$((i + 1))
    sleep 1
done
echo "engine.sh: dockerd did not answer within ${WAIT_SECONDS}s; last lines of $LOGFILE:" >&2
tail -n 30 "$LOGFILE" >&2 || true
exit 1
