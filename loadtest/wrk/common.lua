-- Shared by the cryptd and OpenBao wrk scripts: scenario payloads, arguments, the JSON report.

local signing = require("signing")

local M = {}

M.PAYLOAD_BYTES = 1024 -- the "1 KiB" of the AES scenarios
M.MESSAGE_BYTES = 32 -- message signed by the sign scenarios
M.BATCH_ITEMS = 100

function M.read_file(path)
  local handle, err = io.open(path, "rb")
  if handle == nil then
    error("cannot read " .. path .. ": " .. tostring(err))
  end
  local data = handle:read("*a")
  handle:close()
  return data
end

-- Deterministic filler bytes: the payload's content does not matter, only its size.
function M.payload(size)
  local out = {}
  for i = 1, size do
    out[i] = string.char((i * 131 + 7) % 256)
  end
  return table.concat(out)
end

-- `n` bytes from the kernel CSPRNG (nonce prefixes must differ across threads and runs).
function M.urandom(n)
  local handle = io.open("/dev/urandom", "rb")
  if handle == nil then
    error("cannot open /dev/urandom")
  end
  local data = handle:read(n)
  handle:close()
  return data
end

-- Arguments after `--`: scenario name, then an optional file holding the exact request body
-- (the runner writes one for decrypt scenarios, whose ciphertext must come from the target),
-- then an optional request path: with body file and path, any scenario of the runner's runs,
-- listed here or not (the post-quantum ones are described in loadtest/scenarios.py only).
function M.parse_args(args, scenarios, usage)
  local name = args[1]
  local scenario = name and scenarios[name]
  if name and args[2] and args[3] then
    scenario = { path = args[3] }
  end
  if scenario == nil then
    local names = {}
    for key in pairs(scenarios) do
      names[#names + 1] = key
    end
    table.sort(names)
    error(usage .. "\nscenarios: " .. table.concat(names, ", "))
  end
  local body = args[2] and M.read_file(args[2]) or scenario.body
  if body == nil then
    error("scenario " .. name .. " needs a body file (it carries a ciphertext): -- " .. name
      .. " BODY_FILE")
  end
  return name, scenario, body
end

-- done(): one machine-readable line the runner parses (latency in microseconds).
function M.report(summary, latency)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,'
      .. '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
      .. '"latency_us":{"mean":%.1f,"stdev":%.1f,"min":%d,"max":%d,'
      .. '"p50":%d,"p90":%d,"p99":%d,"p999":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency.stdev, latency.min, latency.max,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9)))
end

M.b64 = signing.base64

return M
