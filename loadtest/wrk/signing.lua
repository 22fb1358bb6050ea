-- RFC 9421 hmac-sha256 request signing for cryptd, in plain LuaJIT (the Lua wrk embeds).
--
-- SHA-256 (FIPS 180-4), HMAC (RFC 2104) and base64 (RFC 4648 section 4) on LuaJIT's 32-bit
-- `bit` operations, so a load generator signs every request the way a real client does.
-- tests/test_loadtest_lua.py checks every function byte for byte against Python's hashlib,
-- hmac, base64 and service.auth.signature.sign_request.
--
-- This is a load-test client, not a production implementation: it is not constant-time and
-- the service never runs it.

local bit = require("bit")
local band, bor, bxor, bnot = bit.band, bit.bor, bit.bxor, bit.bnot
local lshift, rshift, ror, tobit = bit.lshift, bit.rshift, bit.ror, bit.tobit
local byte, char, sub, rep, format = string.byte, string.char, string.sub, string.rep, string.format
local concat, floor = table.concat, math.floor

local M = {}

M.CONTENT_TYPE = "application/json"
M.COVERED = '("@method" "@path" "@query" "content-digest" "content-type")'
M.ALGORITHM = "hmac-sha256"
M.LABEL = "sig1"

-- First 32 bits of the fractional parts of the cube roots of the first 64 primes.
local K = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
}
for i = 1, 64 do
  K[i] = tobit(K[i])
end

local H0 = {
  0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
}
for i = 1, 8 do
  H0[i] = tobit(H0[i])
end

local W = {} -- message schedule, reused (one Lua state per wrk thread: no sharing)

-- Process the 64-byte block of `s` that starts after `offset` bytes, updating state H.
local function compress(H, s, offset)
  for j = 1, 16 do
    local p = offset + (j - 1) * 4
    local a, b, c, d = byte(s, p + 1, p + 4)
    W[j] = bor(lshift(a, 24), lshift(b, 16), lshift(c, 8), d)
  end
  for j = 17, 64 do
    local w15, w2 = W[j - 15], W[j - 2]
    local s0 = bxor(ror(w15, 7), ror(w15, 18), rshift(w15, 3))
    local s1 = bxor(ror(w2, 17), ror(w2, 19), rshift(w2, 10))
    -- Sums of four int32 values are exact in a double; tobit wraps them mod 2^32.
    W[j] = tobit(W[j - 16] + s0 + W[j - 7] + s1)
  end
  local a, b, c, d, e, f, g, h = H[1], H[2], H[3], H[4], H[5], H[6], H[7], H[8]
  for j = 1, 64 do
    local s1 = bxor(ror(e, 6), ror(e, 11), ror(e, 25))
    local ch = bxor(band(e, f), band(bnot(e), g))
    local t1 = h + s1 + ch + K[j] + W[j]
    local s0 = bxor(ror(a, 2), ror(a, 13), ror(a, 22))
    local maj = bxor(band(a, b), band(a, c), band(b, c))
    h, g, f, e = g, f, e, tobit(d + t1)
    d, c, b, a = c, b, a, tobit(t1 + s0 + maj)
  end
  H[1], H[2], H[3], H[4] = tobit(H[1] + a), tobit(H[2] + b), tobit(H[3] + c), tobit(H[4] + d)
  H[5], H[6], H[7], H[8] = tobit(H[5] + e), tobit(H[6] + f), tobit(H[7] + g), tobit(H[8] + h)
end

local function be32(x)
  return char(band(rshift(x, 24), 255), band(rshift(x, 16), 255), band(rshift(x, 8), 255),
    band(x, 255))
end

-- SHA-256 of `prefix .. msg` where `state` is the hash state after the 64-byte `prefix`
-- (lets HMAC reuse its padded-key blocks); plain SHA-256 when both are nil.
local function sha256_from(msg, state, prefix_len)
  local H = { H0[1], H0[2], H0[3], H0[4], H0[5], H0[6], H0[7], H0[8] }
  if state ~= nil then
    for i = 1, 8 do
      H[i] = state[i]
    end
  end
  local n = #msg
  local full = n - n % 64
  for offset = 0, full - 1, 64 do
    compress(H, msg, offset)
  end
  local bits = (n + (prefix_len or 0)) * 8
  local hi, lo = floor(bits / 4294967296), bits % 4294967296
  local tail_len = n - full
  local zeros = (55 - tail_len) % 64
  local tail = sub(msg, full + 1) .. "\128" .. rep("\0", zeros) .. be32(tobit(hi)) .. be32(tobit(lo))
  for offset = 0, #tail - 1, 64 do
    compress(H, tail, offset)
  end
  return H
end

local function state_bytes(H)
  return be32(H[1]) .. be32(H[2]) .. be32(H[3]) .. be32(H[4]) .. be32(H[5]) .. be32(H[6])
    .. be32(H[7]) .. be32(H[8])
end

-- SHA-256 digest of `msg` (32 raw bytes).
function M.sha256(msg)
  return state_bytes(sha256_from(msg))
end

local function xor_pad(key, pad)
  local out = {}
  for i = 1, 64 do
    out[i] = char(bxor(byte(key, i), pad))
  end
  return concat(out)
end

-- A reusable HMAC-SHA256 key: the states after the ipad and opad blocks, computed once.
function M.hmac_key(key)
  if #key > 64 then
    key = M.sha256(key)
  end
  key = key .. rep("\0", 64 - #key)
  local inner, outer = { H0[1], H0[2], H0[3], H0[4], H0[5], H0[6], H0[7], H0[8] }, {
    H0[1], H0[2], H0[3], H0[4], H0[5], H0[6], H0[7], H0[8],
  }
  compress(inner, xor_pad(key, 0x36), 0)
  compress(outer, xor_pad(key, 0x5c), 0)
  return { inner = inner, outer = outer }
end

-- HMAC-SHA256 of `msg` under `key` (a string, or a table from hmac_key).
function M.hmac_sha256(key, msg)
  if type(key) == "string" then
    key = M.hmac_key(key)
  end
  local inner = state_bytes(sha256_from(msg, key.inner, 64))
  return state_bytes(sha256_from(inner, key.outer, 64))
end

local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
local B64_CHARS = {}
for i = 1, 64 do
  B64_CHARS[i - 1] = sub(B64, i, i)
end
-- Every 12-bit value as its two base64 characters: one lookup per 6 input bits pair.
local B64_PAIRS = {}
for i = 0, 4095 do
  B64_PAIRS[i] = B64_CHARS[rshift(i, 6)] .. B64_CHARS[band(i, 63)]
end

-- Standard padded base64 (RFC 4648 section 4).
function M.base64(data)
  local n = #data
  local out = {}
  local k = 0
  local full = n - n % 3
  for i = 1, full, 3 do
    local a, b, c = byte(data, i, i + 2)
    local v = bor(lshift(a, 16), lshift(b, 8), c)
    k = k + 1
    out[k] = B64_PAIRS[rshift(v, 12)] .. B64_PAIRS[band(v, 4095)]
  end
  local rest = n - full
  if rest == 1 then
    local a = byte(data, n)
    k = k + 1
    out[k] = B64_PAIRS[lshift(a, 4)] .. "=="
  elseif rest == 2 then
    local a, b = byte(data, n - 1, n)
    local v = bor(lshift(a, 16), lshift(b, 8))
    k = k + 1
    out[k] = B64_PAIRS[rshift(v, 12)] .. B64_CHARS[band(rshift(v, 6), 63)] .. "="
  end
  return concat(out)
end

function M.hex(data)
  return (data:gsub(".", function(c)
    return format("%02x", byte(c))
  end))
end

-- Content-Digest field value (RFC 9530, sha-256) of `body`.
function M.content_digest(body)
  return "sha-256=:" .. M.base64(M.sha256(body)) .. ":"
end

-- The four headers that authenticate one request, exactly as
-- service.auth.signature.sign_request writes them. `key` is the decoded secret (string) or
-- a table from hmac_key; `created` an integer; `nonce` printable ASCII without '"' or '\'.
-- `digest` (optional) is content_digest(body) computed earlier for a body sent many times.
function M.sign(method, path, query, body, client_id, key, created, nonce, digest)
  digest = digest or M.content_digest(body)
  local params = M.COVERED .. ";created=" .. format("%d", created) .. ';nonce="' .. nonce
    .. '";keyid="' .. client_id .. '";alg="' .. M.ALGORITHM .. '"'
  if path == "" then
    path = "/"
  end
  local base = '"@method": ' .. method:upper() .. '\n"@path": ' .. path .. '\n"@query": ?' .. query
    .. '\n"content-digest": ' .. digest .. '\n"content-type": ' .. M.CONTENT_TYPE
    .. '\n"@signature-params": ' .. params
  return {
    ["Content-Type"] = M.CONTENT_TYPE,
    ["Content-Digest"] = digest,
    ["Signature-Input"] = M.LABEL .. "=" .. params,
    ["Signature"] = M.LABEL .. "=:" .. M.base64(M.hmac_sha256(key, base)) .. ":",
  }
end

-- Decode standard padded base64 (the client secret in client.json).
function M.unbase64(text)
  local values = {}
  for i = 1, 64 do
    values[byte(B64, i)] = i - 1
  end
  text = text:gsub("%s", "")
  if #text % 4 ~= 0 or text:find("[^A-Za-z0-9+/=]") or text:find("=[^=]") then
    error("invalid base64")
  end
  local out = {}
  for i = 1, #text, 4 do
    local a, b, c, d = byte(text, i, i + 3)
    local v = lshift(values[a], 18) + lshift(values[b], 12) + lshift(values[c] or 0, 6)
      + (values[d] or 0)
    out[#out + 1] = char(band(rshift(v, 16), 255))
    if c ~= 61 then
      out[#out + 1] = char(band(rshift(v, 8), 255))
    end
    if d ~= 61 then
      out[#out + 1] = char(band(v, 255))
    end
  end
  return concat(out)
end

return M
