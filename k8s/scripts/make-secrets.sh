#!/bin/bash
# Build the Secrets cryptd's manifests reference, from files, as YAML on stdout:
#
#   cryptd-master-key  master.key     base64 master key (cryptd master-key generate --out FILE)
#   cryptd-keyring     keyring.json   keyring, every version wrapped under the master key
#   cryptd-clients     clients.json   API clients (cryptd clients add ... --file FILE)
#   cryptd-redis       url            redis://cryptd:PASSWORD@HOST:6379/0, for the cryptd pods
#                      users.acl      Redis ACL: default user off, user "cryptd" by password hash
#   cryptd-keystore    url            postgresql://... (k8s/postgresql: --keystore-url-file
#                                     instead of --keyring)
#   cryptd-keystore-ca ca.crt         the CA that signed the database's certificate, for
#                                     sslmode=verify-full (--keystore-ca, required with the URL)
#   cryptd-tls         tls.crt        only with --tls-cert/--tls-key/--tls-ca, where cert-manager
#                      tls.key        does not make it (k8s/base/certificate.yaml): the server's
#                      ca.crt         certificate chain, its key and the issuing CA
#
# Nothing is sent to a cluster: `kubectl create secret --dry-run=client -o yaml` only renders.
# Apply with:  k8s/scripts/make-secrets.sh ARGS | kubectl apply -f -
# The output holds secret material: pipe it, never commit or log it.
#
# The Redis password is read from --redis-password-file; if that file does not exist, a new
# random password is written there first (mode 0600). Keep it: re-running with a different
# password changes both sides, and Redis and cryptd only read it at start.

set -euo pipefail
umask 077

readonly PROG="make-secrets"

usage() {
    cat >&2 <<EOF
usage: $0 --master-key FILE (--keyring FILE | --keystore-url-file FILE --keystore-ca FILE)
          --clients FILE --redis-password-file FILE
          [--namespace NS] [--redis-host HOST] [--redis-port PORT]
          [--tls-cert FILE --tls-key FILE --tls-ca FILE]
EOF
    exit 64
}

fail() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 1
}

namespace=""
master_key=""
keyring=""
clients=""
redis_password_file=""
keystore_url_file=""
keystore_ca=""
redis_host="cryptd-redis"
redis_port="6379"
tls_cert=""
tls_key=""
tls_ca=""

while (($#)); do
    case "$1" in
        --master-key) master_key="${2:?}"; shift 2 ;;
        --keyring) keyring="${2:?}"; shift 2 ;;
        --clients) clients="${2:?}"; shift 2 ;;
        --redis-password-file) redis_password_file="${2:?}"; shift 2 ;;
        --keystore-url-file) keystore_url_file="${2:?}"; shift 2 ;;
        --keystore-ca) keystore_ca="${2:?}"; shift 2 ;;
        -n | --namespace) namespace="${2:?}"; shift 2 ;;
        --redis-host) redis_host="${2:?}"; shift 2 ;;
        --redis-port) redis_port="${2:?}"; shift 2 ;;
        --tls-cert) tls_cert="${2:?}"; shift 2 ;;
        --tls-key) tls_key="${2:?}"; shift 2 ;;
        --tls-ca) tls_ca="${2:?}"; shift 2 ;;
        -h | --help) usage ;;
        *) printf '%s: unknown argument %s\n' "$PROG" "$1" >&2; usage ;;
    esac
done
[[ -n "$master_key" && -n "$clients" && -n "$redis_password_file" ]] || usage
# One key store: the keyring file (a Secret) or PostgreSQL (its URL in a Secret).
[[ -n "$keyring" || -n "$keystore_url_file" ]] || usage
[[ -n "$keyring" && -n "$keystore_url_file" ]] && fail "--keyring and --keystore-url-file exclude each other"
[[ -n "$keystore_ca" && -z "$keystore_url_file" ]] && fail "--keystore-ca needs --keystore-url-file"
# TLS to the database: the pods verify its certificate against this CA (sslrootcert).
[[ -n "$keystore_url_file" && -z "$keystore_ca" ]] && fail "--keystore-url-file needs --keystore-ca"
command -v kubectl > /dev/null || fail "kubectl not found on PATH"

tls_files=("$tls_cert" "$tls_key" "$tls_ca")
if [[ -n "$tls_cert$tls_key$tls_ca" ]]; then
    [[ -n "$tls_cert" && -n "$tls_key" && -n "$tls_ca" ]] \
        || fail "--tls-cert, --tls-key and --tls-ca go together"
else
    tls_files=()
fi
for file in "$master_key" "$clients" ${keyring:+"$keyring"} ${keystore_url_file:+"$keystore_url_file"} ${keystore_ca:+"$keystore_ca"} "${tls_files[@]}"; do
    [[ -f "$file" && -r "$file" && -s "$file" ]] || fail "$file: missing, unreadable or empty"
done
if [[ -n "$keystore_url_file" ]]; then
    grep -Eq '^postgres(ql)?://' "$keystore_url_file" \
        || fail "$keystore_url_file: want a postgresql:// URL"
fi
# The server refuses anything but 32 bytes; refuse it here, before it reaches a cluster.
key_bytes=$(tr -d ' \n\r' < "$master_key" | base64 -d 2> /dev/null | wc -c) \
    || fail "$master_key: not base64"
[[ "$key_bytes" -eq 32 ]] || fail "$master_key: must decode to 32 bytes"

if [[ ! -e "$redis_password_file" ]]; then
    # 32 random bytes, base64url without padding: safe inside a URL without escaping.
    head -c 32 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n' > "$redis_password_file"
    printf '%s: wrote a new Redis password to %s\n' "$PROG" "$redis_password_file" >&2
fi
password=$(tr -d '\n' < "$redis_password_file")
[[ "$password" =~ ^[A-Za-z0-9_-]{32,}$ ]] \
    || fail "$redis_password_file: want at least 32 characters of [A-Za-z0-9_-]"

work=$(mktemp -d)
trap 'rm -rf -- "$work"' EXIT

printf 'redis://cryptd:%s@%s:%s/0' "$password" "$redis_host" "$redis_port" > "$work/url"
password_hash=$(printf '%s' "$password" | sha256sum | cut -d' ' -f1)
# Only the commands cryptd sends (replay nonces: SET NX EX, and the INFO sections server and
# replication only, which tell a restarted or promoted Redis by its run and replication ids;
# rate limit: one Lua script using TIME, HMGET, HSET, PEXPIRE), only on its own key prefix.
# No admin or dangerous command.
cat > "$work/users.acl" <<EOF
user default off
user cryptd on #$password_hash resetkeys ~cryptd:* resetchannels -@all +ping +echo +select +client|setname +client|getname +client|id +set +get +del +exists +expire +pexpire +ttl +pttl +hmget +hset +time +info|server +info|replication +eval +evalsha +script|load +script|exists
EOF

ns_args=()
[[ -n "$namespace" ]] && ns_args=(--namespace "$namespace")

render() {
    local name="$1"
    shift
    printf -- '---\n'
    kubectl create secret generic "$name" "${ns_args[@]}" "$@" --dry-run=client -o yaml
}

render cryptd-master-key --from-file=master.key="$master_key"
if [[ -n "$keyring" ]]; then
    render cryptd-keyring --from-file=keyring.json="$keyring"
else
    # The URL file's content as it is, without a trailing newline.
    tr -d '\n' < "$keystore_url_file" > "$work/keystore-url"
    render cryptd-keystore --from-file=url="$work/keystore-url"
    render cryptd-keystore-ca --from-file=ca.crt="$keystore_ca"
fi
render cryptd-clients --from-file=clients.json="$clients"
render cryptd-redis --from-file=url="$work/url" --from-file=users.acl="$work/users.acl"
if ((${#tls_files[@]})); then
    render cryptd-tls --type=kubernetes.io/tls --from-file=tls.crt="$tls_cert" \
        --from-file=tls.key="$tls_key" --from-file=ca.crt="$tls_ca"
fi
