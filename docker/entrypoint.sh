#!/bin/bash
# Container entrypoint for cryptd.
#
# Checks the environment the server needs before it starts, so that a missing Secret or a
# read-only metrics volume fails the pod at once with a clear message instead of a traceback
# later, then replaces itself with `cryptd serve` (exec) so SIGTERM reaches the server directly.
#
# It writes nothing except inside PROMETHEUS_MULTIPROC_DIR, which it empties of stale metric
# files: a restarted container keeps its emptyDir, and files left by dead worker processes
# would otherwise be summed into the new process's metrics.
#
# Administrative subcommands (keys, keystore, master-key, clients, call, bench) are passed straight to
# `cryptd` without the server checks, e.g. `docker run --rm IMAGE master-key generate`.

set -euo pipefail
umask 0027

readonly PROG="cryptd-entrypoint"
readonly EX_CONFIG=78 # sysexits.h: configuration error

fail() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit "$EX_CONFIG"
}

note() {
    printf '%s: %s\n' "$PROG" "$*" >&2
}

# A configured file must exist, be a regular file (or a symlink to one, as Secret volumes are),
# be readable by this user and not be empty. The path is printed, never the content.
require_file() {
    local var="$1"
    local path="${!var:-}"
    [[ -n "$path" ]] || fail "$var is not set"
    [[ -e "$path" ]] || fail "$var=$path does not exist (is the Secret mounted?)"
    [[ -f "$path" ]] || fail "$var=$path is not a regular file"
    [[ -r "$path" ]] || fail "$var=$path is not readable by uid $(id -u)"
    [[ -s "$path" ]] || fail "$var=$path is empty"
}

require_writable_dir() {
    local var="$1"
    local path="${!var:-}"
    [[ -n "$path" ]] || fail "$var is not set"
    [[ -d "$path" ]] || fail "$var=$path is not a directory (mount an emptyDir there)"
    [[ -w "$path" && -x "$path" ]] || fail "$var=$path is not writable by uid $(id -u)"
}

check_server_environment() {
    if [[ "${CRYPTD_ENV:-production}" != "development" ]]; then
        # Other seals (pkcs11, shamir) keep the master key out of the environment and files.
        if [[ "${CRYPTD_SEAL:-static}" != "static" ]]; then
            :
        elif [[ -n "${CRYPTD_MASTER_KEY:-}" ]]; then
            note "using CRYPTD_MASTER_KEY from the environment; a mounted file (CRYPTD_MASTER_KEY_FILE) is preferred"
        else
            require_file CRYPTD_MASTER_KEY_FILE
        fi
        # The keyring file is the key store unless PostgreSQL is (CRYPTD_KEYSTORE_URL).
        if [[ -z "${CRYPTD_KEYSTORE_URL:-}" ]]; then
            require_file CRYPTD_KEYRING_FILE
        fi
        require_file CRYPTD_CLIENTS_FILE
    fi
    # The server's certificate, key and client CA (the Secret cryptd-tls), when configured: a
    # Secret not mounted yet is named here, not reported by OpenSSL as a bare "PEM lib".
    local tls_var
    for tls_var in CRYPTD_TLS_CERT_FILE CRYPTD_TLS_KEY_FILE CRYPTD_TLS_CLIENT_CA_FILE; do
        if [[ -n "${!tls_var:-}" ]]; then
            require_file "$tls_var"
        fi
    done

    export TMPDIR="${TMPDIR:-/tmp}"
    require_writable_dir TMPDIR

    case "${CRYPTD_METRICS:-true}" in
        false | False | FALSE | 0 | no | off) return 0 ;;
    esac
    require_writable_dir PROMETHEUS_MULTIPROC_DIR
    local stale
    shopt -s nullglob
    for stale in "$PROMETHEUS_MULTIPROC_DIR"/*.db; do
        rm -f -- "$stale" || fail "cannot remove stale metrics file $stale"
    done
    shopt -u nullglob
}

case "${1:-}" in
    keys | keystore | master-key | clients | call | bench | --help | -h)
        exec cryptd "$@"
        ;;
esac

check_server_environment
exec cryptd serve "$@"
