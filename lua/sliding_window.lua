-- aiolimit: sliding window counter (algorithm code "sw"), after J. Carlson's 2014 design,
-- and the fixed window (code "fw": the same counter with one bucket per window).
--
-- Pair parameters (from decide.lua's ARGV): amount (integer), period P (integer µs),
-- param = precision p (integer µs, 0 < p <= P). No aux key.
-- The window is the last n = ceil(P / p) buckets of width p, aligned to the epoch, the current
-- one included. With p == P that is a calendar-aligned fixed window. A non-dividing p makes the
-- window slightly longer than P, never shorter: it errs on the side of refusing.
-- Storage: main HASH fields "w<P>/<p>:<bucket index>" (fixed window: "f<P>/<P>:<index>")
-- = weight charged in that bucket.
-- Stale buckets are deleted on every write; the key's TTL covers the newest bucket's life.

local function sw_buckets(s, pair)
  local cache = s.sw
  if not cache then
    cache = {}
    s.sw = cache
    for field, value in pairs(s.fields) do
      local name, idx = string.match(field, '^([wf][^:]+):(%d+)$')
      if name then
        local b = cache[name]
        if not b then b = {}; cache[name] = b end
        b[tonumber(idx)] = tonumber(value)
      end
    end
  end
  -- "sw" stores under "w", "fw" under "f" (the header's field names).
  local name = (pair.code == 'fw' and 'f' or 'w') .. pair.period_s .. '/' .. pair.param_s
  local b = cache[name]
  if not b then b = {}; cache[name] = b end
  return name, b
end

local function sw_geometry(pair, now)
  local p = pair.param
  local n = math.ceil(pair.period / p)
  local cur = math.floor(now / p)
  return p, n, cur
end

-- Sorted indexes of the non-empty buckets inside the window.
local function sw_live(b, cur, n)
  local idxs = {}
  for idx, count in pairs(b) do
    if idx > cur - n and idx <= cur and count > 0 then idxs[#idxs + 1] = idx end
  end
  table.sort(idxs)
  return idxs
end

local sliding_window = {
  check = function(s, pair, now, weight)
    local _, b = sw_buckets(s, pair)
    local p, n, cur = sw_geometry(pair, now)
    local idxs = sw_live(b, cur, n)
    local count = 0
    for _, idx in ipairs(idxs) do count = count + b[idx] end
    if count + weight <= pair.amount then
      -- After a charge the current bucket is the newest; with weight 0 (the state after a
      -- refund) it is the newest non-empty one, and an empty window is full already.
      local reset = 0
      if weight > 0 then
        reset = (cur + n) * p - now
      elseif #idxs > 0 then
        reset = (idxs[#idxs] + n) * p - now
      end
      return true, pair.amount - count - weight, 0, reset
    end
    local retry = 0
    local freed = 0
    for _, idx in ipairs(idxs) do
      freed = freed + b[idx]
      if count - freed + weight <= pair.amount then
        retry = (idx + n) * p - now
        break
      end
    end
    local reset = 0
    if #idxs > 0 then reset = (idxs[#idxs] + n) * p - now end
    local remaining = pair.amount - count
    if remaining < 0 then remaining = 0 end
    return false, remaining, retry, reset
  end,

  charge = function(s, pair, now, weight)
    local name, b = sw_buckets(s, pair)
    local p, n, cur = sw_geometry(pair, now)
    for idx, _ in pairs(b) do
      if idx <= cur - n then
        b[idx] = nil
        stage_del(s, name .. ':' .. fmt(idx))
      end
    end
    b[cur] = (b[cur] or 0) + weight
    stage_set(s, name .. ':' .. fmt(cur), fmt(b[cur]))
    want_ttl(s, math.ceil(((cur + n) * p - now) / 1000))
  end,

  -- Gives `weight` back. With `at` (the time of the charge being undone) only that bucket is
  -- credited; without it the newest buckets are credited first. Never below zero.
  refund = function(s, pair, now, weight, at)
    local name, b = sw_buckets(s, pair)
    local p, n, cur = sw_geometry(pair, now)
    local idxs
    if at then
      idxs = {math.floor(at / p)}
    else
      idxs = sw_live(b, cur, n)
    end
    local left = weight
    for i = #idxs, 1, -1 do
      local idx = idxs[i]
      local have = b[idx] or 0
      if idx > cur - n and have > 0 and left > 0 then
        local take = math.min(have, left)
        left = left - take
        b[idx] = have - take
        if b[idx] == 0 then
          stage_del(s, name .. ':' .. fmt(idx))
        else
          stage_set(s, name .. ':' .. fmt(idx), fmt(b[idx]))
        end
      end
    end
    want_ttl(s, math.ceil(((cur + n) * p - now) / 1000))
  end,
}

ALGORITHMS.sw = sliding_window
ALGORITHMS.fw = sliding_window
