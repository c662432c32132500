#!/bin/bash
# Build the Docker images for the warren compose cluster.
#
#   warren-base:bookworm  a minimal Debian bookworm rootfs made with
#                         `debootstrap --variant=minbase` (plus python3 and
#                         python3-venv) and loaded with `docker import`.
#                         Built once: skipped when the image already exists
#                         (WARREN_REBUILD_BASE=1 forces a rebuild).
#   warren-haproxy:bookworm  the compose cluster's TCP load balancer: the
#                         same kind of rootfs with Debian's haproxy package,
#                         also built once (WARREN_REBUILD_BASE=1 rebuilds it);
#                         its configuration, docker/haproxy.cfg, is mounted by
#                         docker-compose.yml.
#   warren:latest         docker/Dockerfile on top of the base image; it
#                         installs wheels prepared here on the host into a
#                         venv at /opt/warren, with `pip --no-index`, so the
#                         build itself needs no network at all.
#
# No image registry is used.  The only network traffic is debootstrap
# talking to the Debian mirror this host's apt already uses, and pip on the
# host fetching the dependency wheels from the package index pip is
# configured for.
#
# Needs root (debootstrap) and a running Docker engine (`make docker-engine`).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
wheels="$here/wheels"

BASE_IMAGE=${WARREN_BASE_IMAGE:-warren-base:bookworm}
LB_IMAGE=${WARREN_LB_IMAGE:-warren-haproxy:bookworm}
APP_IMAGE=${WARREN_IMAGE:-warren:latest}
SUITE=bookworm
PYVER=3.11   # python3 in bookworm
# Tags the dependency wheels may carry; bookworm has glibc 2.36.
PLATFORMS=(manylinux2014_x86_64 manylinux_2_28_x86_64)

log() { printf '[build-image] %s\n' "$*" >&2; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# The Debian mirror that apt on this host uses for the main archive of
# $SUITE: one-line *.list files and deb822 *.sources files are both read.
debian_mirror() {
    if [ -n "${WARREN_DEBIAN_MIRROR:-}" ]; then
        echo "$WARREN_DEBIAN_MIRROR"
        return
    fi
    local files=() f
    [ -f /etc/apt/sources.list ] && files+=(/etc/apt/sources.list)
    for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && files+=("$f")
    done
    local url=""
    if [ ${#files[@]} -gt 0 ]; then
        url=$(awk -v suite="$SUITE" '
            # deb822 stanza collected so far: print its first URI when it
            # is a "deb" stanza for the suite.
            function flush() {
                if (!done && types ~ /(^|[ \t])deb([ \t]|$)/ && enabled != "no") {
                    n = split(suites, s, /[ \t]+/)
                    for (i = 1; i <= n; i++) if (s[i] == suite) {
                        m = split(uris, u, /[ \t]+/)
                        for (j = 1; j <= m; j++) if (u[j] != "") { print u[j]; done = 1; exit }
                    }
                }
                types = ""; suites = ""; uris = ""; enabled = ""
            }
            FNR == 1 { flush() }
            FILENAME ~ /\.sources$/ {
                if ($0 ~ /^[ \t]*$/) { flush(); next }
                if ($0 ~ /^[ \t]*#/) next
                key = tolower($1)
                val = $0; sub(/^[^:]*:[ \t]*/, "", val)
                if (key == "types:") types = val
                else if (key == "suites:") suites = val
                else if (key == "uris:") uris = val
                else if (key == "enabled:") enabled = tolower(val)
                next
            }
            /^[ \t]*deb[ \t]/ {
                i = 2
                if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite) { print $i; done = 1; exit }
            }
            END { flush() }
        ' "${files[@]}" 2>/dev/null | head -n 1)
    fi
    echo "${url:-http://deb.debian.org/debian}"
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

# build_rootfs_image IMAGE PACKAGES CMD: a debootstrap minbase rootfs of
# $SUITE with PACKAGES (comma-separated), imported as IMAGE running CMD (JSON).
build_rootfs_image() {
    local image=$1 packages=$2 cmd=$3
    if image_exists "$image" && [ "${WARREN_REBUILD_BASE:-0}" != 1 ]; then
        log "$image exists, not rebuilding it (WARREN_REBUILD_BASE=1 forces it)"
        return
    fi
    if [ "$(id -u)" != 0 ]; then
        log "debootstrap needs root"
        exit 1
    fi
    command -v debootstrap >/dev/null || { log "debootstrap is missing: run \`make docker-engine\`"; exit 1; }
    local mirror t0 rootfs
    mirror=$(debian_mirror)
    t0=$(now)
    rootfs=$(mktemp -d /var/tmp/warren-rootfs.XXXXXX)
    # shellcheck disable=SC2064
    trap "rm -rf '$rootfs'" EXIT
    log "debootstrap --variant=minbase $SUITE from $mirror into $rootfs"
    debootstrap --variant=minbase --include="$packages" \
        "$SUITE" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
        log "debootstrap failed; last lines of $rootfs.log:"
        tail -n 30 "$rootfs.log" >&2
        exit 1
    }
    rm -f "$rootfs.log"
    # Keep the image small: no package caches, lists, docs or man pages.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb \
        "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* \
        "$rootfs"/usr/share/man/* \
        "$rootfs"/usr/share/info/* \
        "$rootfs"/var/log/*.log \
        "$rootfs"/var/log/apt/* \
        "$rootfs"/tmp/* "$rootfs"/var/tmp/*
    # debootstrap copies the host's resolv.conf and hostname; docker
    # provides both at run time.
    : >"$rootfs/etc/resolv.conf"
    rm -f "$rootfs/etc/hostname"
    log "rootfs ready after $(elapsed "$t0")s ($(du -sh "$rootfs" | cut -f1)), importing"
    tar --numeric-owner --xattrs -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change "CMD $cmd" \
        --message "debootstrap --variant=minbase $SUITE (+$packages)" \
        - "$image" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
    log "built $image in $(elapsed "$t0")s"
}

build_base() {
    build_rootfs_image "$BASE_IMAGE" python3,python3-venv '["/bin/bash"]'
}

# haproxy in the foreground (-db), its configuration mounted at run time.
build_lb() {
    build_rootfs_image "$LB_IMAGE" haproxy '["haproxy", "-db", "-f", "/etc/haproxy/haproxy.cfg"]'
}

# The [project] dependencies of pyproject.toml, one requirement a line.
project_dependencies() {
    python3 - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
for req in project.get("dependencies", []):
    print(req)
PY
}

prepare_wheels() {
    local t0 src
    t0=$(now)
    mkdir -p "$wheels"
    rm -f "$wheels"/warren-*.whl
    # Build the warren wheel from a copy of the work tree, so that the
    # setuptools build leaves no build/ or *.egg-info behind in the repo.
    src=$(mktemp -d /tmp/warren-src.XXXXXX)
    tar -C "$repo" --exclude=./.git --exclude=./docker/wheels --exclude='*.egg-info' \
        --exclude=./build --exclude=./dist --exclude='__pycache__' -cf - . | tar -C "$src" -xf -
    log "pip wheel --no-deps (warren)"
    # A fixed SOURCE_DATE_EPOCH makes the wheel depend on the sources only,
    # so an unchanged tree gives the same bytes and docker reuses its cache.
    SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-315532800} \
        python3 -m pip wheel --quiet --no-deps -w "$wheels" "$src"
    rm -rf "$src"
    local deps=() plat_args=() p
    mapfile -t deps < <(project_dependencies)
    for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done
    if [ ${#deps[@]} -gt 0 ]; then
        # The wheels an earlier build downloaded usually satisfy every requirement: try them
        # alone first (no index asked, about half the time), the index only when one is missing.
        if python3 -m pip download --quiet --no-index --find-links "$wheels" -d "$wheels" \
                --only-binary=:all: --python-version "$PYVER" --implementation cp \
                "${plat_args[@]}" "${deps[@]}" 2>/dev/null; then
            log "pip download: every requirement met by the wheels already in $wheels"
        else
            log "pip download: ${deps[*]}"
            python3 -m pip download --quiet -d "$wheels" --only-binary=:all: \
                --python-version "$PYVER" --implementation cp "${plat_args[@]}" "${deps[@]}"
        fi
    fi
    log "wheels ready in $(elapsed "$t0")s: $(cd "$wheels" && ls -- *.whl | tr '\n' ' ')"
}

build_app() {
    local t0 old new
    t0=$(now)
    old=$(docker image inspect -f '{{.Id}}' "$APP_IMAGE" 2>/dev/null || true)
    log "docker build -t $APP_IMAGE"
    docker build --quiet -t "$APP_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" \
        -f "$here/Dockerfile" "$here" >/dev/null
    new=$(docker image inspect -f '{{.Id}}' "$APP_IMAGE")
    # Drop the image this one replaces, so rebuilds do not pile up untagged
    # images; but only when no other tag (warren:latest and the test's
    # warren:test may share one image) and no container still uses it.
    if [ -n "$old" ] && [ "$old" != "$new" ] \
        && [ "$(docker image inspect -f '{{len .RepoTags}}' "$old" 2>/dev/null)" = 0 ]; then
        docker rmi "$old" >/dev/null 2>&1 || true
    fi
    log "built $APP_IMAGE in $(elapsed "$t0")s"
}

main() {
    docker info >/dev/null 2>&1 || { log "no Docker engine answers: run \`make docker-engine\`"; exit 1; }
    local t0
    t0=$(now)
    build_base
    build_lb
    prepare_wheels
    build_app
    log "done in $(elapsed "$t0")s"
}

main "$@"
