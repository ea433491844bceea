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
-- with offsets from the base, ascending. One field per limit keeps HGETALL, parsing and memory
-- proportional to the limits, not to their buckets, and the order makes a sort unnecessary.
-- Buckets that left the window are dropped on every write; the key's TTL covers the newest
-- bucket's life. Bucket indexes and weights stay far below 1e14, so Lua prints them exactly.

-- Built on first use in a call (see prelude.lua's algorithm()).
FACTORIES.sw = function()
  local function sw_name(pair)
    return (pair.code == 'fw' and 'f' or 'w') .. pair.period_s .. '/' .. pair.param_s
  end

  -- The limit's buckets as two ascending arrays {i = indexes, c = weights}, parsed once per call
  -- and shared by the pairs of that limit.
  local function sw_buckets(s, pair)
    local name = sw_name(pair)
    local cache = s.sw
    if not cache then
      cache = {}
      s.sw = cache
    end
    local b = cache[name]
    if not b then
      local i, c = {}, {}
      local raw = s.fields[name]
      if raw then
        local base, rest = string.match(raw, '^(%d+);(.*)$')
        base = tonumber(base)
        if base then
          local k = 0
          for offset, weight in string.gmatch(rest, '(%d+):(%d+)') do
            k = k + 1
            i[k] = base + tonumber(offset)
            c[k] = tonumber(weight)
          end
        end
      end
      b = {i = i, c = c}
      cache[name] = b
    end
    return name, b
  end

  local function sw_geometry(pair, now)
    local p = pair.param
    local n = math.ceil(pair.period / p)
    return p, n, math.floor(now / p)
  end

  -- Positions of the first and last non-empty buckets inside the window (nil if none), and
  -- the weight they hold.
  local function sw_span(b, cur, n)
    local i, c = b.i, b.c
    local first, last, count = nil, nil, 0
    for k = 1, #i do
      local idx = i[k]
      if idx > cur - n and idx <= cur and c[k] > 0 then
        if not first then first = k end
        last = k
        count = count + c[k]
      end
    end
    return first, last, count
  end

  -- Writes the window's buckets back (dropping those that left it), or the field away.
  local function sw_store(s, name, b, cur, n)
    local i, c = b.i, b.c
    local parts, base = {}, nil
    for k = 1, #i do
      local idx = i[k]
      if idx > cur - n and idx <= cur and c[k] > 0 then
        if not base then base = idx end
        parts[#parts + 1] = (idx - base) .. ':' .. c[k]
      end
    end
    if base then
      stage_set(s, name, base .. ';' .. table.concat(parts, ','))
    else
      stage_del(s, name)
    end
  end

  local sliding_window = {
    check = function(s, pair, now, weight)
      local _, b = sw_buckets(s, pair)
      local p, n, cur = sw_geometry(pair, now)
      local first, last, count = sw_span(b, cur, n)
      if count + weight <= pair.amount then
        -- After a charge the current bucket is the newest; with weight 0 (the state after a
        -- refund) it is the newest non-empty one, and an empty window is full already.
        local reset = 0
        if weight > 0 then
          reset = (cur + n) * p - now
        elseif last then
          reset = (b.i[last] + n) * p - now
        end
        return true, pair.amount - count - weight, 0, reset
      end
      local retry, freed = 0, 0
      for k = first, last do
        if b.i[k] > cur - n and b.c[k] > 0 then
          freed = freed + b.c[k]
          if count - freed + weight <= pair.amount then
            retry = (b.i[k] + n) * p - now
            break
          end
        end
      end
      local remaining = pair.amount - count
      if remaining < 0 then remaining = 0 end
      return false, remaining, retry, (b.i[last] + n) * p - now
    end,

    charge = function(s, pair, now, weight)
      local name, b = sw_buckets(s, pair)
      local p, n, cur = sw_geometry(pair, now)
      local k = #b.i
      if k > 0 and b.i[k] == cur then
        b.c[k] = b.c[k] + weight
      else
        b.i[k + 1] = cur
        b.c[k + 1] = weight
      end
      sw_store(s, name, b, cur, n)
      want_ttl(s, math.ceil(((cur + n) * p - now) / 1000))
    end,

    -- Gives `weight` back. With `at` (the time of the charge being undone) only that bucket is
    -- credited; without it the newest buckets are credited first. Never below zero.
    refund = function(s, pair, now, weight, at)
      local name, b = sw_buckets(s, pair)
      local p, n, cur = sw_geometry(pair, now)
      local only = at and math.floor(at / p)
      local left = weight
      for k = #b.i, 1, -1 do
        local idx = b.i[k]
        if left > 0 and idx > cur - n and idx <= cur and (not only or idx == only) then
          local take = math.min(b.c[k], left)
          left = left - take
          b.c[k] = b.c[k] - take
        end
      end
      if left < weight then
        sw_store(s, name, b, cur, n)
        want_ttl(s, math.ceil(((cur + n) * p - now) / 1000))
      end
    end,
  }

  return sliding_window
end
FACTORIES.fw = FACTORIES.sw
