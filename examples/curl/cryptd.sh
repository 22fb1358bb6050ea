#!/usr/bin/env bash
# cryptd from bash with curl and openssl: sign (RFC 9421 hmac-sha256), encrypt, decrypt,
# sign and verify. First checks itself against the known-answer vector of docs/AUTH.md.
#
#   CRYPTD_CREDENTIAL=.cryptd-dev/client.json ./cryptd.sh
#   CRYPTD_URL=https://cryptd.example:8443 CRYPTD_CLIENT_ID=app CRYPTD_SECRET=<base64> \
#     CRYPTD_CA_FILE=ca.crt ./cryptd.sh
#
# The credential file is client.json as `cryptd serve --dev` writes it ({url, client_id,
# secret, ca_file?}; a relative ca_file is taken from the file's directory); CRYPTD_URL,
# CRYPTD_CLIENT_ID, CRYPTD_SECRET and CRYPTD_CA_FILE override its fields. CRYPTD_CA_FILE: the
# PEM CA that issued the server's certificate, for https:// with a private CA. Optional:
# CRYPTD_KEY (an encryption key, default aes256-gcm), CRYPTD_SIGNING_KEY (default ecdsa-p256).
# Needs bash, curl, openssl (1.1 or 3), od, sed, tr. See README.md beside this file.
#
# The secret reaches openssl as an argument (-macopt hexkey:...), which other local users can
# see in the process list while it runs: keep this to machines you alone use.
set -euo pipefail

b64() { openssl base64 -A; }

# sign METHOD TARGET BODY_FILE SECRET_B64 CLIENT_ID [CREATED NONCE]
# Prints the four headers, one per line, as curl -H arguments expect them.
sign() {
  local method=$1 target=$2 body_file=$3 secret=$4 client_id=$5
  local created=${6:-$(date +%s)} nonce=${7:-$(openssl rand -hex 16)}
  local path=${target%%\?*} query=""
  [[ $target == *\?* ]] && query=${target#*\?}
  local digest params key_hex mac
  digest="sha-256=:$(openssl dgst -sha256 -binary <"$body_file" | b64):"
  params="(\"@method\" \"@path\" \"@query\" \"content-digest\" \"content-type\")"
  params+=";created=$created;nonce=\"$nonce\";keyid=\"$client_id\";alg=\"hmac-sha256\""
  key_hex=$(printf '%s' "$secret" | openssl base64 -d -A | od -An -v -tx1 | tr -d ' \n')
  # The signature base: no trailing newline.
  mac=$(printf '"@method": %s\n"@path": %s\n"@query": ?%s\n"content-digest": %s\n"content-type": application/json\n"@signature-params": %s' \
    "$method" "$path" "$query" "$digest" "$params" |
    openssl dgst -sha256 -mac HMAC -macopt "hexkey:$key_hex" -binary | b64)
  printf 'Content-Type: application/json\nContent-Digest: %s\nSignature-Input: sig1=%s\nSignature: sig1=:%s:\n' \
    "$digest" "$params" "$mac"
}

# Retries of one call on 429 / 503 (rate limit, overload, a replay store's restart window):
# each retry is signed afresh (new created time and nonce); the wait is the server's
# Retry-After, refused above MAX_DELAY seconds, and all waits of a call stay within MAX_WAIT.
# Only the crypto operations below are retried; never retry key management that changes
# state (create, rotate, PATCH, delete, import, restore): the API has no idempotency key.
MAX_ATTEMPTS=${CRYPTD_MAX_ATTEMPTS:-4} MAX_DELAY=10 MAX_WAIT=30

# call METHOD TARGET BODY -> prints the response body; fails on a status other than 2xx.
call() {
  local method=$1 target=$2 body=$3 body_file head_file response headers line status
  local attempt=1 waited=0 delay tls=()
  body_file=$(mktemp)
  head_file=$(mktemp)
  response=$(mktemp)
  printf '%s' "$body" >"$body_file"
  [[ -n ${CRYPTD_CA_FILE:-} ]] && tls=(--cacert "$CRYPTD_CA_FILE")
  while :; do
    headers=()
    while IFS= read -r line; do headers+=(-H "$line"); done < <(
      sign "$method" "$target" "$body_file" "$CRYPTD_SECRET" "$CRYPTD_CLIENT_ID"
    )
    # --http1.1: curl's defaults otherwise; the body goes exactly as signed (@file).
    status=$(curl -sS --http1.1 "${tls[@]}" -D "$head_file" -o "$response" -w '%{http_code}' \
      -X "$method" "${headers[@]}" --data-binary "@$body_file" "$CRYPTD_URL$target")
    if [[ $status != 429 && $status != 503 ]] || ((attempt >= MAX_ATTEMPTS)); then break; fi
    delay=$(tr -d '\r' <"$head_file" | sed -n 's/^[Rr][Ee][Tt][Rr][Yy]-[Aa][Ff][Tt][Ee][Rr]: *\([0-9]\{1,9\}\)$/\1/p')
    delay=${delay:-1}
    ((delay <= MAX_DELAY && waited + delay <= MAX_WAIT)) || break
    echo "cryptd.sh: $method $target answered $status: retrying in $delay s" >&2
    sleep "$delay"
    waited=$((waited + delay)) attempt=$((attempt + 1))
  done
  cat "$response"
  rm -f "$body_file" "$head_file" "$response"
  [[ $status == 2* ]] || { echo >&2; echo "cryptd.sh: $method $target answered $status" >&2; return 1; }
}

# json_string FILE NAME -> the string value of a top-level field of a small JSON file
json_string() { tr -d '\n' <"$1" | sed -n "s/.*\"$2\"[[:space:]]*:[[:space:]]*\"\([^\"]*\)\".*/\1/p"; }

# The credential file's fields, unless the environment already gives them.
load_credential() {
  local file=${CRYPTD_CREDENTIAL:-} ca
  [[ -n $file ]] || return 0
  [[ -r $file ]] || { echo "cryptd.sh: cannot read CRYPTD_CREDENTIAL=$file" >&2; return 1; }
  : "${CRYPTD_URL:=$(json_string "$file" url)}"
  : "${CRYPTD_CLIENT_ID:=$(json_string "$file" client_id)}"
  : "${CRYPTD_SECRET:=$(json_string "$file" secret)}"
  ca=$(json_string "$file" ca_file)
  if [[ -z ${CRYPTD_CA_FILE:-} && -n $ca ]]; then
    [[ $ca == /* ]] || ca="$(dirname "$file")/$ca"
    CRYPTD_CA_FILE=$ca
  fi
}

# field NAME < JSON -> the string (or true/false) value of a top-level field
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^\",}]*\)\"\{0,1\}.*/\1/p"; }

self_test() {
  local body_file expected got
  body_file=$(mktemp)
  printf '%s' '{"plaintext":"aGVsbG8gd29ybGQ="}' >"$body_file"
  got=$(sign POST /v1/encrypt/orders "$body_file" "tKtlcrbpPWE/g55NZEzpcmn5vPIer40d8LoQ9x7BR14=" \
    billing 1767225600 E7zF1Eme3Bi9KdgXtME_Mg)
  rm -f "$body_file"
  expected='Content-Type: application/json
Content-Digest: sha-256=:94eAsvH/2QofB45X76r4hBJjeSvuJl7rivOgGXAY5Lk=:
Signature-Input: sig1=("@method" "@path" "@query" "content-digest" "content-type");created=1767225600;nonce="E7zF1Eme3Bi9KdgXtME_Mg";keyid="billing";alg="hmac-sha256"
Signature: sig1=:stH31tVkXcP68lL6vDwKcynKuh5ojw2S9Fb43vySHfM=:'
  if [[ $got != "$expected" ]]; then
    printf 'known-answer vector: MISMATCH\nexpected:\n%s\ngot:\n%s\n' "$expected" "$got" >&2
    return 1
  fi
  echo "known-answer vector: ok"
}

main() {
  self_test
  load_credential
  local need="set CRYPTD_CREDENTIAL (a client.json) or"
  : "${CRYPTD_URL:?$need CRYPTD_URL}" "${CRYPTD_CLIENT_ID:?$need CRYPTD_CLIENT_ID}"
  : "${CRYPTD_SECRET:?$need CRYPTD_SECRET}"
  [[ -z ${CRYPTD_CA_FILE:-} || -r $CRYPTD_CA_FILE ]] || {
    echo "cryptd.sh: cannot read the CA file $CRYPTD_CA_FILE" >&2; return 1; }
  local key=${CRYPTD_KEY:-aes256-gcm} signing_key=${CRYPTD_SIGNING_KEY:-ecdsa-p256}
  local message plaintext token decrypted signature valid
  message="hello from bash and curl"
  plaintext=$(printf '%s' "$message" | b64)

  token=$(call POST "/v1/encrypt/$key" "{\"plaintext\":\"$plaintext\"}" | field ciphertext)
  echo "encrypt: $token"
  decrypted=$(call POST "/v1/decrypt/$key" "{\"ciphertext\":\"$token\"}" | field plaintext)
  [[ $(printf '%s' "$decrypted" | openssl base64 -d -A) == "$message" ]] || {
    echo "decrypt: wrong plaintext" >&2; return 1; }
  echo "decrypt: ok"

  signature=$(call POST "/v1/sign/$signing_key" "{\"message\":\"$plaintext\"}" | field signature)
  echo "sign: $signature"
  valid=$(call POST "/v1/verify/$signing_key" \
    "{\"message\":\"$plaintext\",\"signature\":\"$signature\"}" | field valid)
  [[ $valid == true ]] || { echo "verify: not valid" >&2; return 1; }
  echo "verify: ok"
}

main "$@"
