#!/bin/sh
# A local RabbitMQ 3.10 cluster for the benchmarks: N nodes rabbit-1@localhost .. rabbit-N@localhost
# on 127.0.0.1, AMQP ports 5701.., distribution ports 25701.., state under DIR (own mnesia, logs,
# pid files and one shared Erlang cookie in DIR/home). Uses Debian's rabbitmq-server package.
#
#   cluster.sh start DIR [N]     start N nodes (default 3) and cluster them to rabbit-1
#   cluster.sh start-node DIR I  (re)start node I alone (no join: its mnesia remembers the cluster)
#   cluster.sh add-node DIR I    start node I and join it to rabbit-1
#   cluster.sh stop DIR          stop every node started under DIR
#   cluster.sh ctl DIR I ARGS..  rabbitmqctl against node I
#   cluster.sh check             exit 0 when rabbitmq-server is installed
set -eu

SBIN=/usr/lib/rabbitmq/bin
AMQP_BASE=5700
DIST_BASE=25700

check() { [ -x "$SBIN/rabbitmq-server" ] && [ -x "$SBIN/rabbitmqctl" ]; }

node_env() {  # DIR I -> exports the environment of node I
  dir=$1; i=$2
  export HOME="$dir/home"
  export RABBITMQ_NODENAME="rabbit-$i@localhost"
  export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
  export RABBITMQ_NODE_PORT=$((AMQP_BASE + i))
  export RABBITMQ_DIST_PORT=$((DIST_BASE + i))
  export RABBITMQ_MNESIA_BASE="$dir/rabbit-$i/mnesia"
  export RABBITMQ_LOG_BASE="$dir/rabbit-$i/log"
  export RABBITMQ_PID_FILE="$dir/rabbit-$i/pid"
  export RABBITMQ_CONFIG_FILE="$dir/rabbit-$i/rabbitmq"
  export RABBITMQ_ENABLED_PLUGINS_FILE="$dir/rabbit-$i/enabled_plugins"
  export RABBITMQ_ENABLED_PLUGINS=""
  export ERL_CRASH_DUMP="$dir/rabbit-$i/log/erl_crash.dump"
  # three VMs share a small machine with the load generator: no busy-waiting schedulers
  export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="${RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS:-+sbwt none +sbwtdcpu none +sbwtdio none}"
  # the guest user may log in from 127.0.0.1 only, which is where the benchmark runs
}

ctl() { dir=$1; i=$2; shift 2; HOME="$dir/home" ERL_CRASH_DUMP=/dev/null "$SBIN/rabbitmqctl" -n "rabbit-$i@localhost" "$@"; }

start_node() {
  dir=$1; i=$2
  mkdir -p "$dir/home" "$dir/rabbit-$i/log" "$dir/rabbit-$i/mnesia"
  [ -f "$dir/home/.erlang.cookie" ] || { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$dir/home/.erlang.cookie"; chmod 400 "$dir/home/.erlang.cookie"; }
  [ -f "$dir/rabbit-$i/rabbitmq.conf" ] || printf 'loopback_users.guest = false\nvm_memory_high_watermark.relative = 0.2\n' > "$dir/rabbit-$i/rabbitmq.conf"
  [ -f "$dir/rabbit-$i/enabled_plugins" ] || echo '[].' > "$dir/rabbit-$i/enabled_plugins"
  ( node_env "$dir" "$i"; setsid "$SBIN/rabbitmq-server" > "$dir/rabbit-$i/log/console.log" 2>&1 & )
  # wait until the node answers and its app is running (pid file written by the server)
  tries=0
  until ctl "$dir" "$i" await_startup >/dev/null 2>&1; do
    tries=$((tries + 1)); [ $tries -lt 60 ] || { echo "rabbit-$i did not start; see $dir/rabbit-$i/log" >&2; exit 1; }
    sleep 1
  done
}

join() {
  dir=$1; i=$2
  ctl "$dir" "$i" stop_app >/dev/null
  ctl "$dir" "$i" join_cluster rabbit-1@localhost >/dev/null
  ctl "$dir" "$i" start_app >/dev/null
}

cmd=${1:-}; shift || true
case "$cmd" in
  check) check ;;
  start)
    check || { echo "rabbitmq-server is not installed (apt-get install -y rabbitmq-server)" >&2; exit 3; }
    dir=$1; count=${2:-3}; mkdir -p "$dir"
    k=1; while [ $k -le "$count" ]; do start_node "$dir" $k; k=$((k + 1)); done
    k=2; while [ $k -le "$count" ]; do join "$dir" $k; k=$((k + 1)); done
    echo "$count" > "$dir/nodes"
    ctl "$dir" 1 cluster_status >/dev/null ;;
  start-node) start_node "$1" "$2" ;;
  add-node) start_node "$1" "$2"; join "$1" "$2" ;;
  ctl) ctl "$@" ;;
  stop)
    dir=$1
    for pidfile in "$dir"/rabbit-*/pid; do
      [ -f "$pidfile" ] || continue
      pid=$(cat "$pidfile")
      kill "$pid" 2>/dev/null || true
      w=0; while kill -0 "$pid" 2>/dev/null && [ $w -lt 100 ]; do sleep 0.1; w=$((w + 1)); done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$pidfile"
    done ;;
  *) sed -n '2,12p' "$0" >&2; exit 2 ;;
esac
