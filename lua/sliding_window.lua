-- aiolimit: sliding window counter (algorithm code "sw"), after J. Carlson's 2014 design,
-- and the fixed window (code "fw": the same counter with one bucket per window).
--
-- Pair parameters (from decide.lua's ARGV): amount (integer), period P (integer µs),
-- param = precision p (integer µs, 0 < p <= P). No aux key.
-- The window is the last n = ceil(P / p) buckets of width p, aligned to the epoch, the current
-- one included. With p == P that is a calendar-aligned fixed window. A non-dividing p makes the
-- window slightly longer than P, never shorter: it errs on the side of refusing.
-- Storage: ONE main HASH field per limit, "w<P>/<p>" (fixed window: "f<P>/<P>"), holding
-- "<base index>;<total weight>;<offset>:<weight>,<offset>:<weight>..." for the non-empty
-- buckets, offsets from the base, ascending. A call usually reads only the total and the
-- buckets that just left the window, and charges by rewriting the last entry or appending
-- one; the whole field is rebuilt only when buckets leave the window, on refusals and on
-- refunds. Cost and memory follow the limits, not their buckets. The key's TTL covers the
-- newest bucket's life. Every number is written with fmt: under count_refused totals pass 1e14,
-- which Lua's own number-to-text would print as 1e+14.

-- Built on first use in a call (see prelude.lua's algorithm()).
FACTORIES.sw = function()
  local function sw_name(pair)
    return (pair.code == 'fw' and 'f' or 'w') .. pair.period_s .. '/' .. pair.param_s
  end

  -- The limit's stored field, split into base, total and entries; entries are parsed only as
  -- far as a call needs them. Cached per call, shared by the pairs of that limit.
  local function sw_state(s, pair)
    local name = sw_name(pair)
    local cache = s.sw
    if not cache then
      cache = {}
      s.sw = cache
    end
    local b = cache[name]
    if not b then
      b = {name = name, total = 0}
      local raw = s.fields[name]
      if raw then
        local base, total, rest = string.match(raw, '^(%d+);(%d+);(.+)$')
        if base then
          b.base, b.total, b.rest = tonumber(base), tonumber(total), rest
        end
      end
      cache[name] = b
    end
    return b
  end

  local function sw_geometry(pair, now)
    local p = pair.param
    local n = math.ceil(pair.period / p)
    return p, n, math.floor(now / p)
  end

  -- Weight in the buckets at the front that left the window (index <= lo), and how many.
  local function sw_expired(b, lo)
    local sum, count = 0, 0
    if b.rest and b.base <= lo then
      for offset, weight in string.gmatch(b.rest, '(%d+):(%d+)') do
        if b.base + tonumber(offset) > lo then break end
        sum = sum + tonumber(weight)
        count = count + 1
      end
    end
    return sum, count
  end

  -- Every bucket as two ascending arrays (the slow path: refusals, refunds, window moves).
  local function sw_parse(b)
    local i, c = {}, {}
    if b.rest then
      for offset, weight in string.gmatch(b.rest, '(%d+):(%d+)') do
        i[#i + 1] = b.base + tonumber(offset)
        c[#c + 1] = tonumber(weight)
      end
    end
    return i, c
  end

  -- The newest stored bucket's index, or nil.
  local function sw_newest(b)
    if not b.rest then return nil end
    return b.base + tonumber(string.match(b.rest, '(%d+):%d+$'))
  end

  -- Rewrites the field from arrays, keeping only the non-empty buckets inside the window.
  local function sw_rebuild(s, b, i, c, cur, n)
    local parts, base, total = {}, nil, 0
    for k = 1, #i do
      if i[k] > cur - n and i[k] <= cur and c[k] > 0 then
        if not base then base = i[k] end
        parts[#parts + 1] = fmt(i[k] - base) .. ':' .. fmt(c[k])
        total = total + c[k]
      end
    end
    if base then
      b.base, b.total, b.rest = base, total, table.concat(parts, ',')
      stage_set(s, b.name, fmt(base) .. ';' .. fmt(total) .. ';' .. b.rest)
    else
      b.base, b.total, b.rest = nil, 0, nil
      stage_del(s, b.name)
    end
  end

  return {
    check = function(s, pair, now, weight)
      local b = sw_state(s, pair)
      local p, n, cur = sw_geometry(pair, now)
      local count = b.total - sw_expired(b, cur - n)
      if count + weight <= pair.amount then
        -- After a charge the current bucket is the newest; with weight 0 (the state after a
        -- refund) it is the newest non-empty one, and an empty window is full already.
        local reset = 0
        if weight > 0 then
          reset = (cur + n) * p - now
        elseif count > 0 then
          reset = (sw_newest(b) + n) * p - now
        end
        return true, pair.amount - count - weight, 0, reset
      end
      -- Refused: wait until enough of the oldest buckets leave the window.
      local i, c = sw_parse(b)
      local retry, freed = 0, 0
      for k = 1, #i do
        if i[k] > cur - n then
          freed = freed + c[k]
          if count - freed + weight <= pair.amount then
            retry = (i[k] + n) * p - now
            break
          end
        end
      end
      local remaining = pair.amount - count
      if remaining < 0 then remaining = 0 end
      return false, remaining, retry, (sw_newest(b) + n) * p - now
    end,

    charge = function(s, pair, now, weight)
      local b = sw_state(s, pair)
      local p, n, cur = sw_geometry(pair, now)
      local _, expired = sw_expired(b, cur - n)
      if expired > 0 then
        local i, c = sw_parse(b)
        if i[#i] == cur then c[#c] = c[#c] + weight else i[#i + 1] = cur; c[#c + 1] = weight end
        sw_rebuild(s, b, i, c, cur, n)
      else
        -- The common case, in O(1) string work: add to the newest bucket or append one.
        if not b.rest then
          b.base, b.rest = cur, '0:' .. fmt(weight)
        else
          local offset, last = string.match(b.rest, '(%d+):(%d+)$')
          if b.base + tonumber(offset) == cur then
            b.rest = string.sub(b.rest, 1, #b.rest - #last) .. fmt(tonumber(last) + weight)
          else
            b.rest = b.rest .. ',' .. fmt(cur - b.base) .. ':' .. fmt(weight)
          end
        end
        b.total = b.total + weight
        stage_set(s, b.name, fmt(b.base) .. ';' .. fmt(b.total) .. ';' .. b.rest)
      end
      want_ttl(s, math.ceil(((cur + n) * p - now) / 1000))
    end,

    -- Gives `weight` back. With `at` (the time of the charge being undone) only that bucket
    -- is credited; without it the newest buckets are credited first. Never below zero.
    refund = function(s, pair, now, weight, at)
      local b = sw_state(s, pair)
      local p, n, cur = sw_geometry(pair, now)
      local i, c = sw_parse(b)
      local only = at and math.floor(at / p)
      local left = weight
      for k = #i, 1, -1 do
        if left > 0 and i[k] > cur - n and i[k] <= cur and (not only or i[k] == only) then
          local take = math.min(c[k], left)
          left = left - take
          c[k] = c[k] - take
        end
      end
      if left < weight then
        sw_rebuild(s, b, i, c, cur, n)
        want_ttl(s, math.ceil(((cur + n) * p - now) / 1000))
      end
    end,
  }
end
FACTORIES.fw = FACTORIES.sw
