-- Known-answer harness for signing.lua, run by tests/test_loadtest_lua.py under `luajit` or
-- under wrk's own LuaJIT (wrk runs a script's top level before connecting, so
-- `wrk -s selftest.lua http://127.0.0.1:1/` prints the answers and exits).
--
-- Input: the file named by $LT_CASES (or the first argument under luajit), one case a line,
-- tab-separated hex fields: OP ARG... . Output: one line per case, the answer's fields in hex,
-- tab-separated. OPs: sha256 MSG | hmac KEY MSG | b64 DATA | unb64 TEXT | digest BODY |
-- payload SIZE(as decimal text) | sign METHOD PATH QUERY BODY CLIENT_ID SECRET CREATED NONCE
-- (answer: Content-Type, Content-Digest, Signature-Input, Signature).

local dir = debug.getinfo(1, "S").source:match("^@(.*[/\\])") or "./"
package.path = dir .. "?.lua;" .. package.path

local signing = require("signing")
local common = require("common")

local function unhex(text)
  return (text:gsub("%x%x", function(pair)
    return string.char(tonumber(pair, 16))
  end))
end

local hex = signing.hex

local function split(line)
  local fields = {}
  for field in (line .. "\t"):gmatch("([^\t]*)\t") do
    fields[#fields + 1] = field
  end
  return fields
end

local ops = {
  sha256 = function(a)
    return { signing.sha256(a[1]) }
  end,
  hmac = function(a)
    return { signing.hmac_sha256(a[1], a[2]) }
  end,
  b64 = function(a)
    return { signing.base64(a[1]) }
  end,
  unb64 = function(a)
    return { signing.unbase64(a[1]) }
  end,
  digest = function(a)
    return { signing.content_digest(a[1]) }
  end,
  payload = function(a)
    return { common.payload(tonumber(a[1])) }
  end,
  sign = function(a)
    -- The secret goes through hmac_key, as the wrk scripts use it.
    local h = signing.sign(a[1], a[2], a[3], a[4], a[5], signing.hmac_key(a[6]), tonumber(a[7]),
      a[8])
    return { h["Content-Type"], h["Content-Digest"], h["Signature-Input"], h["Signature"] }
  end,
}

local path = os.getenv("LT_CASES") or (arg and arg[1])
if path == nil then
  io.stderr:write("selftest.lua: set LT_CASES to a case file\n")
  os.exit(2)
end

local out = {}
for line in io.lines(path) do
  if line ~= "" then
    local fields = split(line)
    local op = ops[unhex(fields[1])]
    if op == nil then
      io.stderr:write("selftest.lua: unknown op " .. unhex(fields[1]) .. "\n")
      os.exit(2)
    end
    local args = {}
    for i = 2, #fields do
      args[i - 1] = unhex(fields[i])
    end
    local answer = op(args)
    for i = 1, #answer do
      answer[i] = hex(answer[i])
    end
    out[#out + 1] = table.concat(answer, "\t")
  end
end
io.write("SELFTEST ", jit and jit.version or _VERSION, " ", wrk and "wrk" or "luajit", "\n")
io.write(table.concat(out, "\n"), "\n")
io.flush()
os.exit(0)
