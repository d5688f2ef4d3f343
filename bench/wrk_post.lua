-- wrk script: POST an OpenAI chat request; print one JSON line of results when done.
-- Arguments (after `--`): model, body mode ("fixed": the same body every time, a cache hit after the
-- first; "unique": a different prompt per request, a cache miss), path, and a tag that makes
-- "unique" prompts differ between runs, and an optional bearer token.
-- Latency percentiles are wrk's own (microseconds).

local model = "mock"
local mode = "fixed"
local path = "/v1/chat/completions"
local counter = 0
local tag = "t"
local fixed_request

local function body_for(text)
  return '{"model":"' .. model .. '","messages":[{"role":"user","content":"' .. text
    .. '"}],"max_tokens":16,"temperature":0}'
end

function init(args)
  model = args[1] or model
  mode = args[2] or mode
  path = args[3] or path
  tag = args[4] or tag
  if args[5] and args[5] ~= "" then
    wrk.headers["Authorization"] = "Bearer " .. args[5]
  end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  fixed_request = wrk.format("POST", path, nil, body_for("Say hello to the benchmark."))
end

function request()
  if mode == "unique" then
    counter = counter + 1
    return wrk.format("POST", path, nil, body_for("Say hello to request " .. tag .. "-" .. counter .. "."))
  end
  return fixed_request
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"errors":%d,"non_2xx":%d,"timeouts":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"mean_us":%.1f}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
