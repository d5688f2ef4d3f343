-- wrk script: POST an Anthropic Messages request (/v1/messages); print one JSON line of results when done.
-- Arguments (after `--`): model, a tag that makes each run's prompts differ, and an optional key (sent as
-- x-api-key, as Anthropic's SDK does). Every request has a new prompt. Latency percentiles are wrk's own
-- (microseconds).

local model = "mock"
local counter = 0
local tag = "t"

function init(args)
  model = args[1] or model
  tag = args[2] or tag
  if args[3] and args[3] ~= "" then
    wrk.headers["x-api-key"] = args[3]
  end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["anthropic-version"] = "2023-06-01"
end

function request()
  counter = counter + 1
  local body = '{"model":"' .. model .. '","messages":[{"role":"user","content":"Say hello to request ' .. tag
    .. "-" .. counter .. '."}],"max_tokens":16,"temperature":0}'
  return wrk.format("POST", "/v1/messages", nil, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"errors":%d,"non_2xx":%d,"timeouts":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"mean_us":%.1f}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
