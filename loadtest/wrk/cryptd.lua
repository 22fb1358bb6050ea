-- wrk script for cryptd: every request freshly signed (RFC 9421 hmac-sha256, a new nonce and
-- `created` each time), so the signing cost of a real client is part of the measurement.
--
--   CRYPTD_CREDENTIALS=.cryptd-dev/client.json \
--     wrk -t1 -c16 -d10s --latency -s loadtest/wrk/cryptd.lua http://127.0.0.1:8080 \
--     -- aes-encrypt [BODY_FILE]
--
-- Credential: CRYPTD_CREDENTIALS (a client.json written by `cryptd serve --dev`, default
-- .cryptd-dev/client.json) or CRYPTD_CLIENT_ID plus CRYPTD_CLIENT_SECRET (base64).
-- aes-decrypt and rsa-decrypt need BODY_FILE: a JSON body with a ciphertext from this server
-- (loadtest/run.py writes them). The last output line is `WRK_JSON {...}` for the runner.
--
-- Each request gets a fresh nonce, `created` and HMAC, and by default a Content-Digest computed
-- anew. CRYPTD_LT_DIGEST=once computes the digest of the (unchanging) body once per thread:
-- this pure-Lua SHA-256 runs ~100 MB/s, 10-20x slower than a client's C hash, which matters
-- for the 140 KB batch body on cores shared with the server. The server verifies it either way.

local dir = debug.getinfo(1, "S").source:match("^@(.*[/\\])") or "./"
package.path = dir .. "?.lua;" .. package.path

local signing = require("signing")
local common = require("common")

local b64 = common.b64
local PLAINTEXT = b64(common.payload(common.PAYLOAD_BYTES))
local MESSAGE = b64(common.payload(common.MESSAGE_BYTES))

local function batch_body()
  local item = '{"plaintext":"' .. PLAINTEXT .. '"}'
  local items = {}
  for i = 1, common.BATCH_ITEMS do
    items[i] = item
  end
  return '{"batch":[' .. table.concat(items, ",") .. "]}"
end

local SIGN = '{"message":"' .. MESSAGE .. '"}'
scenarios = {
  ["aes-encrypt"] = { path = "/v1/encrypt/aes256-gcm", body = '{"plaintext":"' .. PLAINTEXT .. '"}' },
  ["aes-decrypt"] = { path = "/v1/decrypt/aes256-gcm" },
  ["rsa-sign"] = { path = "/v1/sign/rsa-2048", body = '{"message":"' .. MESSAGE .. '","algorithm":"pss"}' },
  ["rsa-decrypt"] = { path = "/v1/decrypt/rsa-2048" },
  ["ecdsa-sign"] = { path = "/v1/sign/ecdsa-p256", body = SIGN },
  ["ed25519-sign"] = { path = "/v1/sign/ed25519", body = SIGN },
  ["sm2-sign"] = { path = "/v1/sign/sm2", body = SIGN },
  ["aes-batch"] = { path = "/v1/encrypt/aes256-gcm", body = batch_body() },
}

local function credential()
  local id, secret = os.getenv("CRYPTD_CLIENT_ID"), os.getenv("CRYPTD_CLIENT_SECRET")
  if id == nil or secret == nil then
    local path = os.getenv("CRYPTD_CREDENTIALS") or ".cryptd-dev/client.json"
    local text = common.read_file(path)
    id = text:match('"client_id"%s*:%s*"([^"]*)"')
    secret = text:match('"secret"%s*:%s*"([^"]*)"')
    if id == nil or secret == nil then
      error(path .. " has no client_id/secret")
    end
  end
  return id, signing.hmac_key(signing.unbase64(secret))
end

local next_thread = 0
function setup(thread)
  next_thread = next_thread + 1
  thread:set("thread_id", next_thread)
end

local path, body, client_id, key, nonce_prefix, digest
local counter = 0

function init(args)
  local _, scenario
  _, scenario, body = common.parse_args(args, scenarios,
    "usage: wrk ... -s cryptd.lua URL -- SCENARIO [BODY_FILE]")
  path = scenario.path
    client_id, key = credential()
  if os.getenv("CRYPTD_LT_DIGEST") == "once" then
    digest = signing.content_digest(body)
  end
  -- Nonce: CSPRNG prefix (unique per thread and run) + thread id + per-thread counter.
  nonce_prefix = b64(common.urandom(9)) .. "-" .. tostring(thread_id or 0) .. "-"
end

function request()
  counter = counter + 1
  local headers = signing.sign("POST", path, "", body, client_id, key, os.time(),
    nonce_prefix .. counter, digest)
  return wrk.format("POST", path, headers, body)
end

function done(summary, latency, _requests)
  common.report(summary, latency)
end
