-- wrk script for OpenBao's Transit engine: the same scenarios as cryptd.lua, authenticated the
-- way OpenBao clients are (an X-Vault-Token header).
--
--   BAO_TOKEN=root wrk -t1 -c16 -d10s --latency -s loadtest/wrk/openbao.lua \
--     http://127.0.0.1:8200 -- aes-encrypt [BODY_FILE]
--
-- Keys (created by loadtest/run.py): aes256-gcm96 "aes", rsa-2048 "rsa-2048", ecdsa-p256
-- "ecdsa-p256", ed25519 "ed25519" under transit/. aes-decrypt and rsa-decrypt need BODY_FILE.

local dir = debug.getinfo(1, "S").source:match("^@(.*[/\\])") or "./"
package.path = dir .. "?.lua;" .. package.path

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
  return '{"batch_input":[' .. table.concat(items, ",") .. "]}"
end

local SIGN = '{"input":"' .. MESSAGE .. '"}'
scenarios = {
  ["aes-encrypt"] = { path = "/v1/transit/encrypt/aes", body = '{"plaintext":"' .. PLAINTEXT .. '"}' },
  ["aes-decrypt"] = { path = "/v1/transit/decrypt/aes" },
  ["rsa-sign"] = {
    path = "/v1/transit/sign/rsa-2048/sha2-256",
    body = '{"input":"' .. MESSAGE .. '","signature_algorithm":"pss"}',
  },
  ["rsa-decrypt"] = { path = "/v1/transit/decrypt/rsa-2048" },
  ["ecdsa-sign"] = { path = "/v1/transit/sign/ecdsa-p256/sha2-256", body = SIGN },
  ["ed25519-sign"] = { path = "/v1/transit/sign/ed25519", body = SIGN },
  ["aes-batch"] = { path = "/v1/transit/encrypt/aes", body = batch_body() },
}

local request_string

function init(args)
  local _, scenario, body = common.parse_args(args, scenarios,
    "usage: wrk ... -s openbao.lua URL -- SCENARIO [BODY_FILE]")
    local token = os.getenv("BAO_TOKEN") or os.getenv("VAULT_TOKEN")
  if token == nil then
    error("set BAO_TOKEN (or VAULT_TOKEN)")
  end
  -- OpenBao requests do not change from one to the next: build the bytes once.
  request_string = wrk.format("POST", scenario.path,
    { ["X-Vault-Token"] = token, ["Content-Type"] = "application/json" }, body)
end

function request()
  return request_string
end

function done(summary, latency, _requests)
  common.report(summary, latency)
end
