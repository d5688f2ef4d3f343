-- wrk script: POST an OpenAI Responses request (/v1/responses); print one JSON line of results when done.
-- Arguments (after `--`): model, store ("true" keeps every response in Redis, "false" keeps none), a tag
-- that makes each run's prompts differ, and an optional bearer token. Every request has a new prompt.
-- Latency percentiles are wrk's own (microseconds).

local model = "mock"
local store = "false"
local counter = 0
local tag = "t"

function init(args)
  model = args[1] or model
  store = args[2] or store
  tag = args[3] or tag
  if args[4] and args[4] ~= "" then
    wrk.headers["Authorization"] = "Bearer " .. args[4]
  end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  counter = counter + 1
  local body = '{"model":"' .. model .. '","input":"Say hello to request ' .. tag .. "-" .. counter
    .. '.","max_output_tokens":16,"temperature":0,"store":' .. store .. '}'
  return wrk.format("POST", "/v1/responses", nil, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"errors":%d,"non_2xx":%d,"timeouts":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"mean_us":%.1f}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
