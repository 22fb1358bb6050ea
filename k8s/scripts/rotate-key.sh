#!/bin/bash
# Rotate a cryptd key across every replica, without a restart.
#
#   1. Take a copy of the keyring: the operator's secure copy (--keyring FILE), or the one in the
#      cluster's Secret (--from-cluster).
#   2. `cryptd keys rotate NAME` on that copy, in a private temporary directory. The new version
#      is wrapped under the master key (--master-key FILE); older versions are untouched, so
#      every existing ciphertext keeps decrypting.
#   3. Save the rotated keyring to the secure copy FIRST (--keyring FILE is updated in place, the
#      previous file kept as FILE.<UTC time>.bak; or --out FILE), then apply the Secret. In that
#      order no ciphertext can ever be made under a version the secure copy lacks.
#   4. Apply the Secret (`kubectl apply`), or print it with --dry-run. The kubelet refreshes the
#      mounted file within its sync period (about a minute; never with subPath mounts) and every
#      pod reloads it within CRYPTD_KEYRING_RELOAD_INTERVAL: new encryptions use the new version.
#
# Requires: cryptd (pip install .), kubectl, coreutils.

set -euo pipefail
umask 077

readonly PROG="rotate-key"

usage() {
    cat >&2 <<EOF
usage: $0 KEY_NAME --master-key FILE (--keyring FILE | --from-cluster [--out FILE])
          [--namespace NS] [--secret NAME] [--dry-run]

  --keyring FILE    the operator's secure copy; rotated in place (old copy kept as .bak)
  --from-cluster    read the keyring from the Secret instead (kubectl get secret)
  --out FILE        where to save the rotated keyring (required with --from-cluster)
  --secret NAME     Secret holding keyring.json (default: cryptd-keyring)
  --dry-run         print the new Secret instead of applying it; nothing is written
EOF
    exit 64
}

fail() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 1
}

note() {
    printf '%s: %s\n' "$PROG" "$*" >&2
}

key_name=""
master_key=""
keyring=""
from_cluster=false
out=""
namespace=""
secret="cryptd-keyring"
dry_run=false

while (($#)); do
    case "$1" in
        --master-key) master_key="${2:?}"; shift 2 ;;
        --keyring) keyring="${2:?}"; shift 2 ;;
        --from-cluster) from_cluster=true; shift ;;
        --out) out="${2:?}"; shift 2 ;;
        -n | --namespace) namespace="${2:?}"; shift 2 ;;
        --secret) secret="${2:?}"; shift 2 ;;
        --dry-run) dry_run=true; shift ;;
        -h | --help) usage ;;
        -*) printf '%s: unknown option %s\n' "$PROG" "$1" >&2; usage ;;
        *) [[ -z "$key_name" ]] || usage; key_name="$1"; shift ;;
    esac
done
[[ -n "$key_name" && -n "$master_key" ]] || usage
if $from_cluster; then
    [[ -z "$keyring" ]] || fail "--keyring and --from-cluster exclude each other"
    $dry_run || [[ -n "$out" ]] || fail "--from-cluster needs --out FILE: keep the rotated keyring"
else
    [[ -n "$keyring" ]] || usage
    [[ -f "$keyring" && -r "$keyring" ]] || fail "$keyring: missing or unreadable"
fi
[[ -f "$master_key" && -r "$master_key" ]] || fail "$master_key: missing or unreadable"
command -v cryptd > /dev/null || fail "cryptd not found on PATH (pip install .)"
command -v kubectl > /dev/null || fail "kubectl not found on PATH"

ns_args=()
[[ -n "$namespace" ]] && ns_args=(--namespace "$namespace")

work=$(mktemp -d)
trap 'rm -rf -- "$work"' EXIT
copy="$work/keyring.json"

if $from_cluster; then
    kubectl get secret "$secret" "${ns_args[@]}" -o 'jsonpath={.data.keyring\.json}' \
        | base64 -d > "$copy" || fail "cannot read keyring.json from Secret $secret"
    [[ -s "$copy" ]] || fail "Secret $secret has no keyring.json"
else
    cp -- "$keyring" "$copy"
fi
cp -- "$copy" "$work/before.json"

# The copy is the only writable keyring here; CRYPTD_* from the caller's shell must not point
# the CLI anywhere else.
env -u CRYPTD_MASTER_KEY -u CRYPTD_KEYRING_FILE CRYPTD_KEYRING_READ_ONLY=false \
    cryptd keys rotate "$key_name" --keyring "$copy" --master-key-file "$master_key" \
    > "$work/rotated.json" || fail "cryptd keys rotate $key_name failed"
cmp -s "$copy" "$work/before.json" && fail "the keyring did not change"
note "rotated $key_name: $(tr -d ' \n' < "$work/rotated.json")"

kubectl create secret generic "$secret" "${ns_args[@]}" \
    --from-file=keyring.json="$copy" --dry-run=client -o yaml > "$work/secret.yaml"

if $dry_run; then
    cat -- "$work/secret.yaml"
    note "dry run: nothing written, nothing applied"
    exit 0
fi

# Durable secure copy before the cluster sees the new version.
stamp=$(date -u +%Y%m%dT%H%M%SZ)
if [[ -n "$keyring" ]]; then
    cp -p -- "$keyring" "$keyring.$stamp.bak"
    target="$keyring"
else
    target="$out"
fi
cp -- "$copy" "$target.tmp.$$"
sync -- "$target.tmp.$$" 2> /dev/null || sync
mv -f -- "$target.tmp.$$" "$target"
note "saved the rotated keyring to $target"

kubectl apply -f "$work/secret.yaml"
note "applied Secret $secret; pods reload it within the kubelet sync period (~60 s)"
note "plus CRYPTD_KEYRING_RELOAD_INTERVAL. Check: GET /v1/keys/$key_name on any pod shows the new latest_version."
