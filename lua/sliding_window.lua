-- aiolimit: sliding window counter (algorithm code "sw"), after J. Carlson's 2014 design,
-- and the fixed window (code "fw": the same counter with one bucket per window).
--
-- Pair parameters (from decide.lua's ARGV): amount (integer), period P (integer µs),
-- param = precision p (integer µs, 0 < p <= P). No aux key.
-- The window is the last n = ceil(P / p) buckets of width p, aligned to the epoch, the current
-- one included. With p == P that is a calendar-aligned fixed window. A non-dividing p makes the
-- window slightly longer than P, never shorter: it errs on the side of refusing.
-- Storage: ONE main HASH field per limit, "w<P>/<p>" (fixed window: "f<P>/<P>"), holding the
-- non-empty buckets of the window as "<base index>;<offset>:<weight>,<offset>:<weight>..."
-- (offsets from the base, ascending). One field per limit keeps HGETALL, parsing and memory
-- proportional to the limits, not to their buckets. Buckets that left the window are dropped
-- on every write; the key's TTL covers the newest bucket's life.

local function sw_name(pair)
  return (pair.code == 'fw' and 'f' or 'w') .. pair.period_s .. '/' .. pair.param_s
end

-- The limit's buckets as {index = weight}, parsed once per call and shared by its pairs.
local function sw_buckets(s, pair)
  local name = sw_name(pair)
  local cache = s.sw
  if not cache then
    cache = {}
    s.sw = cache
  end
  local b = cache[name]
  if not b then
    b = {}
    cache[name] = b
    local raw = s.fields[name]
    if raw then
      local base, rest = string.match(raw, '^(%d+);(.*)$')
      base = tonumber(base)
      if base then
        for offset, weight in string.gmatch(rest, '(%d+):(%d+)') do
          b[base + tonumber(offset)] = tonumber(weight)
        end
      end
    end
  end
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

-- Writes the window's buckets back (dropping those that left it), or the field away.
local function sw_store(s, name, b, cur, n)
  local idxs = sw_live(b, cur, n)
  if #idxs == 0 then
    stage_del(s, name)
    return
  end
  local base = idxs[1]
  local parts = {}
  for i, idx in ipairs(idxs) do parts[i] = fmt(idx - base) .. ':' .. fmt(b[idx]) end
  stage_set(s, name, fmt(base) .. ';' .. table.concat(parts, ','))
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
    b[cur] = (b[cur] or 0) + weight
    sw_store(s, name, b, cur, n)
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
      end
    end
    if left < weight then
      sw_store(s, name, b, cur, n)
      want_ttl(s, math.ceil(((cur + n) * p - now) / 1000))
    end
  end,
}

ALGORITHMS.sw = sliding_window
ALGORITHMS.fw = sliding_window
