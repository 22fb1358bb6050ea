#!/usr/bin/env bash
# Make a stand-in for the Dockerfile's default base (python:3.11-slim-bookworm) from Debian's
# own packages, for builders that cannot reach a container registry:
#
#     docker/debian-base.sh [--cache-dir DIR] OUT.tar
#     docker/debian-base.sh --print-key
#
# writes a root filesystem tarball: `debootstrap --variant=minbase bookworm` with Debian's
# Python 3.11, the packages the official slim image adds (ca-certificates, netbase, tzdata),
# every update from bookworm-updates and bookworm-security, and pip bootstrapped from Debian's
# own pip wheel so that the Dockerfile's `python -m pip wheel|install|uninstall` steps run
# unchanged. Import it as an image (`buildah from scratch` + `buildah add`, or `docker import`)
# and pass it as the PYTHON_IMAGE build argument. How it differs from the official image:
# docs/DEPLOY.md, "The image without a registry".
#
# Needs root, debootstrap and chroot (Debian packages debootstrap, coreutils). --cache-dir
# keeps the downloaded .deb files between runs (debootstrap's and apt's), so a rebuild fetches
# only what changed. --print-key prints a digest of everything the tarball is made from: this
# script, the mirrors, the architecture and the package indices the suites publish now, so a
# cached tarball can be reused until Debian publishes an update.
set -euo pipefail
umask 0022

readonly SUITE=bookworm
readonly MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
readonly SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
# python3 (3.11 in bookworm) and `python` on PATH; the pip and setuptools wheels pip is
# bootstrapped from; what python:3.11-slim-bookworm installs on top of Debian's minbase.
readonly PACKAGES=(python3 python-is-python3 python3-pip-whl python3-setuptools-whl
    ca-certificates netbase tzdata)

ARCH="$(dpkg --print-architecture)"
readonly ARCH

# The SHA-256 lines of each suite's InRelease for its package index: they change exactly when
# a package the base could contain changes.
index_digests() {
    local dists
    for dists in "$MIRROR/dists/$SUITE" "$MIRROR/dists/$SUITE-updates" \
        "$SECURITY_MIRROR/dists/$SUITE-security"; do
        wget -qO- "$dists/InRelease" | grep -E "^ [0-9a-f]{64} +[0-9]+ main/binary-$ARCH/Packages"
    done
}

if [[ "${1:-}" == --print-key ]]; then
    { sha256sum <"$0"; echo "$MIRROR $SECURITY_MIRROR $ARCH"; index_digests; } \
        | sha256sum | cut -c1-16
    exit 0
fi

cache_dir=""
while [[ $# -gt 1 ]]; do
    case "$1" in
        --cache-dir) cache_dir="$2"; shift 2 ;;
        *) break ;;
    esac
done
[[ $# -eq 1 ]] || { echo "usage: $0 [--cache-dir DIR] OUT.tar" >&2; exit 2; }
out="$1"

work="$(mktemp -d "${TMPDIR:-/tmp}/cryptd-debian-base.XXXXXX")"
root="$work/rootfs"
cleanup() {
    local mounted
    for mounted in "$root/var/cache/apt/archives" "$root/proc"; do
        if mountpoint -q "$mounted" 2>/dev/null && ! umount "$mounted"; then
            echo "$0: $mounted is still mounted; $work left in place" >&2
            return
        fi
    done
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT

# A step's output is shown only when it fails.
quietly() {
    if ! "$@" >"$work/step.log" 2>&1; then
        cat "$work/step.log" >&2
        echo "$0: failed: $*" >&2
        exit 1
    fi
}

# Commands in the new root run with a clean environment (only a proxy setting passes): none
# of the caller's PIP_* options, locale or paths reach the base.
in_root() {
    local -a pass=()
    local name
    for name in http_proxy https_proxy no_proxy; do
        if [[ -n "${!name:-}" ]]; then pass+=("$name=${!name}"); fi
    done
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
        DEBIAN_FRONTEND=noninteractive "${pass[@]}" chroot "$root" "$@"
}

debootstrap_args=(--variant=minbase --include="$(IFS=,; echo "${PACKAGES[*]}")")
if [[ -n "$cache_dir" ]]; then
    mkdir -p "$cache_dir/debootstrap" "$cache_dir/apt"
    debootstrap_args+=(--cache-dir="$(realpath "$cache_dir/debootstrap")")
fi
# Two stages, so that dpkg can skip its fsync calls while it installs into a directory that is
# thrown away on failure and tarred once complete (the setting leaves before the tarball).
readonly UNSAFE_IO=/etc/dpkg/dpkg.cfg.d/cryptd-base-unsafe-io
quietly debootstrap --foreign "${debootstrap_args[@]}" "$SUITE" "$root" "$MIRROR"
echo force-unsafe-io >"$root$UNSAFE_IO"
# As in Debian's "slim" images, which the official image is built on: no documentation, manual
# pages or translations, now or from later installs; the copyright files stay.
readonly SLIM=/etc/dpkg/dpkg.cfg.d/docker-slim
printf 'path-exclude %s\n' /usr/share/doc/\* /usr/share/info/\* /usr/share/linda/\* \
    /usr/share/lintian/overrides/\* /usr/share/locale/\* /usr/share/man/\* >"$root$SLIM"
printf 'path-include %s\n' /usr/share/doc/\*/copyright >>"$root$SLIM"
quietly in_root /debootstrap/debootstrap --second-stage

# Updates and security fixes, as the official image has them at its build time.
cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
mount -t proc proc "$root/proc"
if [[ -n "$cache_dir" ]]; then
    mount --bind "$cache_dir/apt" "$root/var/cache/apt/archives"
    mkdir -p "$root/var/cache/apt/archives/partial"
fi
quietly in_root apt-get update
quietly in_root apt-get -y -o Dpkg::Use-Pty=0 dist-upgrade
if [[ -n "$cache_dir" ]]; then umount "$root/var/cache/apt/archives"; fi

# pip and setuptools from Debian's wheels into /usr/local (where pip puts what root installs
# with Debian's Python, and where the official image keeps its pip). Debian disables ensurepip
# for its system Python and marks it EXTERNALLY-MANAGED (PEP 668); the marker goes, as the
# official image has none: nothing in this base is managed by both dpkg and pip.
# shellcheck disable=SC2016 # expanded by the shell in the new root
in_root sh -c 'cd /usr/share/python-wheels && set -- pip-*.whl && exec python3 "$1/pip" install \
    --quiet --no-index --no-cache-dir --disable-pip-version-check --root-user-action=ignore \
    --break-system-packages pip-*.whl setuptools-*.whl'
in_root python3 -m pip --version >/dev/null
rm -f "$root"/usr/lib/python3.*/EXTERNALLY-MANAGED
quietly in_root dpkg --purge python3-pip-whl python3-setuptools-whl

# What an image does not carry: package lists and caches, logs, the build host's identity,
# device nodes (the engine provides /dev).
in_root apt-get clean
umount "$root/proc"
rm -rf "$root$UNSAFE_IO" "$root"/var/lib/apt/lists/* "$root"/var/cache/debconf/*-old "$root"/var/log/* \
    "$root"/tmp/* "$root"/root/.cache
slim_paths=(usr/share/info usr/share/linda usr/share/lintian/overrides usr/share/locale
    usr/share/man)
for path in "${slim_paths[@]}"; do
    if [[ -d "$root/$path" ]]; then find "$root/$path" -mindepth 1 -delete; fi
done
find "$root/usr/share/doc" -mindepth 1 -not -type d -not -name copyright -delete
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
find "$root/dev" -mindepth 1 -delete
: >"$root/etc/resolv.conf"
: >"$root/etc/hostname"

mkdir -p "$(dirname "$out")"
tar --numeric-owner --xattrs --acls -C "$root" -cf "$out.tmp" .
mv "$out.tmp" "$out"
