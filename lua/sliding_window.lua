-- aiolimit: sliding window counter (algorithm code "sw"), after J. Carlson's 2014 design,
-- and the fixed window (code "fw": the same counter with one bucket per window).
--
-- Pair parameters (from decide.lua's ARGV): amount (integer), period P (integer µs),
-- param = precision p (integer µs, 0 < p <= P). No aux key.
-- The window is the last n = ceil(P / p) buckets of width p, aligned to the epoch, the current
-- one included. With p == P that is a calendar-aligned fixed window. A non-dividing p makes the
-- window slightly longer than P, never shorter: it errs on the side of refusing.
-- Storage: ONE main HASH field per limit, "w<P>/<p>" (fixed window: "f<P>/<P>"), holding
--   "<base>|<c0>|<offset>:<c>,<offset>:<c>..."
-- one record per non-empty bucket, ascending: the bucket's index less base, and c, the running
-- total charged up to and including that bucket (so c grows along the records); c0 is the
-- running total before the first record. The weight in the window is
--   c(newest record) - c(newest record that left the window, else c0)
-- and every question a call asks is a binary search on the string, by offset or by c: a
-- record starts at 1 or after a ",", so halving a byte range and finding the next "," lands on
-- a record (string.find, C speed; a record is under 64 bytes). The newest record is found
-- from the end the same way. So a call does O(log n) Lua work whatever the number of buckets:
--   check   the count (one search); a refusal's retry_after (a second search, by c: when the
--           bucket holding unit number count + weight - amount leaves);
--   charge  drops the records that left (one search, one string.sub) and rewrites the newest
--           record or appends one;
--   refund  newest first: one search by c finds the record that keeps the new total, the
--           rest of the string is cut;
--   undo    (`at` given: only the bucket of that time is credited) lowers c of the k records
--           after it, O(k): the limiter undoes within a round trip, so k is a few buckets.
--           A bucket holding less than the undo's weight (a refund, newest first, took some
--           of it for weight charged earlier) gives the rest from the older buckets, newest
--           first (sw_spill, O(records), rare): as if the op had never charged.
-- Bytes still move in proportion to the buckets (HGETALL, HSET and string.sub copy the field,
-- ~10-25 bytes a bucket), at memory speed; aiolimit/_limits.py caps n (MAX_BUCKETS) so that
-- stays well under a millisecond. Memory: at most n records; the key's TTL covers the newest
-- bucket's life. Every number is written with fmt: under count_refused totals pass 1e14, which
-- Lua's own number-to-text would print as 1e+14.

-- A window is empty when its newest record's bucket has left it (see STALE in prelude.lua).
local function sw_stale(name, value, now)
  local period, precision = string.match(name, '^[wf](%d+)/(%d+)$')
  local base, at = string.match(value, '^(%d+)|%d+|()')
  if not period or not at then return false end
  -- the newest record, found from the end as sw_tail finds it (records are under 64 bytes)
  local from = #value - 64
  if from < at then from = at end
  local offset = string.match(value, '.*,(%d+):%d+$', from)
                 or string.match(value, '^(%d+):%d+$', at)
  if not offset then return false end
  local p = tonumber(precision)
  if p <= 0 then return false end
  local n = math.ceil(tonumber(period) / p)
  return tonumber(base) + tonumber(offset) <= math.floor(now / p) - n
end
STALE[119] = sw_stale  -- 'w'
STALE[102] = sw_stale  -- 'f'

local REBASE_AT = 2 ^ 52  -- see sw_rebase

-- Built on first use in a call (see prelude.lua's algorithm()).
FACTORIES.sw = function()
  local function sw_name(pair)
    return (pair.code == 'fw' and 'f' or 'w') .. pair.period_s .. '/' .. pair.param_s
  end

  -- The record starting at byte `pos`: its offset and running total.
  local function rec(rest, pos)
    local offset, c = string.match(rest, '^(%d+):(%d+)', pos)
    return tonumber(offset), tonumber(c)
  end

  -- The start of the record after the one starting at `pos`, or nil.
  local function next_rec(rest, pos)
    local comma = string.find(rest, ',', pos, true)
    return comma and comma + 1
  end

  -- The start of the last record whose offset (which == 1) or running total (which == 2) is
  -- at most `target`, or nil. Binary search on bytes: O(log #rest) finds of a ",".
  local function last_at_most(rest, which, target)
    if select(which, rec(rest, 1)) > target then return nil end
    local lo, hi = 1, #rest + 1  -- lo: a record within target; none at or after hi is
    while true do
      local mid = math.floor((lo + hi) / 2)
      if mid <= lo then mid = lo + 1 end
      local start = nil
      if mid < hi then
        local comma = string.find(rest, ',', mid - 1, true)
        if comma and comma + 1 < hi then start = comma + 1 end
      end
      if start then
        if select(which, rec(rest, start)) <= target then lo = start else hi = start end
      elseif mid == lo + 1 then
        return lo
      else
        hi = mid
      end
    end
  end

  -- Sets the newest record's fields of b from b.rest (nil: the field is empty): where it
  -- starts (last), where its ":" is (colon), its bucket index (newest) and running total.
  -- Records are under 64 bytes, so the last "," is in the last 64 (one match, from the end).
  -- The first record's fields (first_off, first_c) are read again when next asked for.
  local function sw_tail(b)
    local rest = b.rest
    b.first_off, b.first_c = nil, nil
    if rest then
      local from = #rest - 64
      if from < 1 then from = 1 end
      local last, offset, colon, c = string.match(rest, '.*,()(%d+)():(%d+)$', from)
      if not last then last, offset, colon, c = string.match(rest, '^()(%d+)():(%d+)$') end
      b.last, b.colon, b.newest, b.total = last, colon, b.base + tonumber(offset), tonumber(c)
    else
      b.base, b.c0, b.last, b.colon, b.newest, b.total = nil, 0, nil, nil, nil, 0
    end
  end

  -- The first record's offset and running total (b.rest is not nil).
  local function first_rec(b)
    local offset = b.first_off
    if not offset then
      offset, b.first_c = rec(b.rest, 1)
      b.first_off = offset
    end
    return offset, b.first_c
  end

  -- The limit's stored field, parsed only as far as its ends. Cached per call, shared by the
  -- pairs of that limit.
  -- The limit's field name (what depends on the spec alone is made once per spec).
  local function sw_field(pair)
    local spec = pair.spec
    local name = spec.sw_name
    if not name then
      name = sw_name(pair)
      spec.sw_name = name
      spec.sw_n = math.ceil(pair.period / pair.param)
    end
    return name
  end

  -- Parsing a field costs about as much as the rest of a decision (string.match, tonumber:
  -- strtod). As a FUNCTION library, what the previous write of a field left is usually what
  -- the next call reads, so sw_store files each state it writes under the text it wrote, and
  -- a call that reads that exact text copies the parse instead (the parse is a function of
  -- the text alone). A filed state is the live one of its call: it carries the text in
  -- `stored`, which every change clears first (charge, refund), so a state changed after it
  -- was filed (a later call of a batch, or one that failed before it wrote) is never used for
  -- the old text. At most PARSED_SIZE states, or PARSED_BYTES of text, are filed; then the
  -- table starts again. (A state holds its text twice, as the key and as `rest`: without the
  -- byte bound a hot window of MAX_BUCKETS buckets, ~130 KB a text, kept ~500 MB alive.)
  -- Texts repeat across identifiers (many hold the same few counts in the same buckets), so a
  -- few hundred states hit nearly always (95-99 % with 128, 256 identifiers in turn); the
  -- bound is kept small for Redis' GC (see LEDGERS in decide.lua).
  local PARSED, parsed_count, PARSED_SIZE = {}, 0, 256
  local parsed_bytes, PARSED_BYTES = 0, 262144

  local function sw_state(s, pair)
    local name = sw_field(pair)
    local cache = s.sw
    if not cache then
      cache = {}
      s.sw = cache
    end
    local b = cache[name]
    if not b then
      local raw = read_field(s, name)
      local m = raw and PARSED[raw]
      if m and m.stored == raw then
        b = {name = name, base = m.base, c0 = m.c0, rest = m.rest, head = m.head,
             head_base = m.head_base, head_c0 = m.head_c0, first_off = m.first_off,
             first_c = m.first_c, last = m.last, colon = m.colon, newest = m.newest,
             total = m.total, stored = raw}
        cache[name] = b
        return b
      end
      -- (every field named, so the table is made at its full size)
      b = {name = name, base = nil, c0 = nil, rest = nil, head = nil, head_base = nil,
           head_c0 = nil, first_off = nil, first_c = nil, last = nil, colon = nil,
           newest = nil, total = nil, stored = nil}
      if raw then
        local head, base, c0, rest = string.match(raw, '^((%d+)|(%d+)|)(.+)$')
        if base then
          b.base, b.c0, b.rest = tonumber(base), tonumber(c0), rest
          -- The stored "<base>|<c0>|", written again as is while base and c0 stay.
          b.head, b.head_base, b.head_c0 = head, b.base, b.c0
        end
      end
      sw_tail(b)
      cache[name] = b
    end
    return b
  end

  -- Files state `b` under the text `value` it was written as (see PARSED above).
  local function sw_file(value, b)
    if parsed_count >= PARSED_SIZE or parsed_bytes >= PARSED_BYTES then
      PARSED, parsed_count, parsed_bytes = {}, 0, 0
    end
    if not PARSED[value] then
      parsed_count, parsed_bytes = parsed_count + 1, parsed_bytes + #value
    end
    PARSED[value] = b
  end

  local function sw_store(s, b)
    if b.rest then
      local head = b.head
      if not head or b.head_base ~= b.base or b.head_c0 ~= b.c0 then
        head = fmt(b.base) .. '|' .. fmt(b.c0) .. '|'
      end
      local value = head .. b.rest
      stage_set(s, b.name, value)
      b.head, b.head_base, b.head_c0, b.stored = head, b.base, b.c0, value
      -- Filed only when a parse of the text would give this state: every number fmt wrote
      -- is in [0, 2^63) (else it printed a "-"), and the newest record is a whole one within
      -- the last 64 bytes, where sw_tail looks. (A field edited by hand, or far-fetched
      -- arguments, can break either: a later call must then fail or read as a fresh parse.)
      if b.base >= 0 and b.newest >= b.base and b.newest < 2 ^ 63 and b.c0 < 2 ^ 63
         and b.total < 2 ^ 63
         and (b.last == 1 or #b.rest - b.last < 64) then
        sw_file(value, b)
      else
        b.stored = nil
      end
    else
      stage_del(s, b.name)
    end
  end

  local function sw_geometry(pair, now)
    local p = pair.param
    return p, pair.spec.sw_n, math.floor(now / p)
  end

  -- Weight in the buckets after index lo, the running total before them, and the start of
  -- the newest record at or before lo (nil if none).
  local function sw_count(b, lo)
    if not b.rest or b.newest <= lo then return 0, b.total, nil end
    if b.base + first_rec(b) > lo then return b.total - b.c0, b.c0, nil end
    local at = last_at_most(b.rest, 1, lo - b.base)
    local before = b.c0
    if at then before = select(2, rec(b.rest, at)) end
    return b.total - before, before, at
  end

  -- Drops the records of buckets at or before index lo (they left the window).
  local function sw_trim(b, lo)
    if not b.rest or b.base + first_rec(b) > lo then return end
    if b.newest <= lo then
      b.rest = nil
    else
      local at = last_at_most(b.rest, 1, lo - b.base)
      local start = next_rec(b.rest, at)
      b.c0 = select(2, rec(b.rest, at))
      b.rest = string.sub(b.rest, start)
    end
    sw_tail(b)
  end

  -- The record starting at `start` is cut to running total `c` (dropped if that leaves it
  -- empty, i.e. c equals the previous record's); every record after it goes.
  local function sw_cut(b, start, c, previous)
    local offset = rec(b.rest, start)
    if c > previous then
      b.rest = string.sub(b.rest, 1, start - 1) .. fmt(offset) .. ':' .. fmt(c)
    elseif start > 1 then
      b.rest = string.sub(b.rest, 1, start - 2)
    else
      b.rest = nil
    end
    sw_tail(b)
  end

  -- Gives back `weight` from the bucket at `offset` and then the older ones, newest first
  -- (an undo whose bucket a refund emptied in part: see refund). O(records): rare.
  local function sw_spill(b, offset, weight)
    local kept, previous, total, left = {}, b.c0, b.c0, weight
    local records = {}
    for o, c in string.gmatch(b.rest, '(%d+):(%d+)') do
      o, c = tonumber(o), tonumber(c)
      records[#records + 1] = {o, c - previous}
      previous = c
    end
    for i = #records, 1, -1 do
      if left == 0 then break end
      local record = records[i]
      if record[1] <= offset then
        local take = math.min(left, record[2])
        record[2], left = record[2] - take, left - take
      end
    end
    for i = 1, #records do
      local record = records[i]
      if record[2] > 0 then
        total = total + record[2]
        kept[#kept + 1] = fmt(record[1]) .. ':' .. fmt(total)
      end
    end
    b.rest = #kept > 0 and table.concat(kept, ',') or nil
    sw_tail(b)
  end

  -- Running totals only grow on a key that never idles (a window empties, and its totals
  -- start again from 0, only when it goes a whole period without a charge). A Lua number
  -- holds integers exactly up to 2^53, and counts are differences of totals: before they
  -- reach REBASE_AT (2^52, so that a charge of at most 2^52 more is exact too; weights are
  -- at most 10^12) every total is lowered by c0, the total before the window's first record
  -- (when that is at least half of it: a window that itself holds 2^51, which only
  -- count_refused could fill so, is past exact counting anyway).
  -- That rewrites each record once, and takes at least 2^52 / (weight a window holds)
  -- charges to come round again: ~4,500 windows of 10^12, i.e. every few hours at the
  -- largest limit kept full, every few centuries at 10^6.
  local function sw_rebase(b)
    local c0 = b.c0
    b.rest = string.gsub(b.rest, '(%d+):(%d+)', function(offset, c)
      return offset .. ':' .. fmt(tonumber(c) - c0)
    end)
    b.c0 = 0
    sw_tail(b)
  end

  -- decide.lua's fast path (see fast_acquire there): an acquire of `weight` on this pair,
  -- from the field's stored text `raw` (nil: none) at `now`, when no record leaves the
  -- window. Allowed: true, the text to store, the pair's remaining, retry_after (0) and
  -- reset_after, the TTL it wants (ms), and its remaining and reset_after as they are now
  -- (what a refused call reports for it); refused: false, nil, remaining, retry_after,
  -- reset_after. All exactly as check, charge and sw_store make them. Else nil: decide() then
  -- takes the general way (nothing is written yet).
  local function sw_fast(raw, pair, now, weight)
    local spec = pair.spec
    local p, n = pair.param, spec.sw_n
    local cur = math.floor(now / p)
    local base, c0, rest, head, first_off, last, colon, newest, total
    if raw then
      local m = PARSED[raw]
      if m and m.stored == raw then
        base, c0, rest, head, first_off = m.base, m.c0, m.rest, m.head, m.first_off
        last, colon, newest, total = m.last, m.colon, m.newest, m.total
      else
        head, base, c0, rest = string.match(raw, '^((%d+)|(%d+)|)(.+)$')
        if not base then return nil end
        base, c0 = tonumber(base), tonumber(c0)
        local b = {rest = rest, base = base}
        sw_tail(b)
        last, colon, newest, total = b.last, b.colon, b.newest, b.total
      end
      -- (read as first_rec reads it: a first record that is not "<offset>:<total>", by hand,
      -- fails the general way's check or trim, so it is left to that)
      if not first_off then first_off = rec(rest, 1) end
      if not first_off then return nil end
      if newest > cur then return nil end  -- (a record ahead of the key's time: by hand)
      if newest <= cur - n then
        rest = nil  -- every record left the window: it starts again, as a charge would
      elseif base + first_off <= cur - n then
        return nil  -- records leave the window: charge trims them
      end
    end
    local count = 0
    if rest then count = total - c0 end
    local amount = pair.amount
    if count + weight > amount then
      -- Refused (as check refuses): wait until the bucket holding unit number
      -- count + weight - amount leaves.
      if not rest then return nil end  -- (a weight above the amount: never sent so)
      local at = last_at_most(rest, 2, total + weight - amount - 1)
      local offset = rec(rest, at and next_rec(rest, at) or 1)
      local remaining = amount - count
      if remaining < 0 then remaining = 0 end
      return false, nil, remaining, (base + offset + n) * p - now, (newest + n) * p - now
    end
    -- What check reports with weight 0, should another pair refuse the call.
    local reset0 = 0
    if count > 0 then reset0 = (newest + n) * p - now end
    if not rest then
      base, c0, rest, head, total = cur, 0, '0:' .. fmt(weight), nil, weight
      last, colon, first_off = 1, 2, 0
    else
      total = total + weight
      if total >= REBASE_AT then return nil end  -- (charge rebases first)
      if newest == cur then
        rest = string.sub(rest, 1, colon) .. fmt(total)
      else
        local offset = fmt(cur - base)
        last = #rest + 2
        rest = rest .. ',' .. offset .. ':' .. fmt(total)
        colon = last + #offset
      end
    end
    if not head then head = fmt(base) .. '|' .. fmt(c0) .. '|' end
    local value = head .. rest
    -- Filed as sw_store files a state (the same bounds; every number here is below 2^52).
    if last == 1 or #rest - last < 64 then
      sw_file(value, {name = spec.sw_name, base = base, c0 = c0, rest = rest, head = head,
                      head_base = base, head_c0 = c0, first_off = first_off, first_c = nil,
                      last = last, colon = colon, newest = cur, total = total, stored = value})
    end
    local reset = (cur + n) * p - now
    return true, value, amount - count - weight, 0, reset, math.ceil(reset / 1000),
           amount - count, reset0
  end

  return {
    field = sw_field,
    fast = sw_fast,

    check = function(s, pair, now, weight)
      local b = sw_state(s, pair)
      local p, n, cur = sw_geometry(pair, now)
      local count, before = sw_count(b, cur - n)
      if count + weight <= pair.amount then
        -- After a charge the current bucket is the newest; with weight 0 (the state after a
        -- refund) it is the newest non-empty one, and an empty window is full already.
        local reset = 0
        if weight > 0 then
          reset = (cur + n) * p - now
        elseif count > 0 then
          reset = (b.newest + n) * p - now
        end
        return true, pair.amount - count - weight, 0, reset
      end
      -- Refused: wait until the bucket holding unit number count + weight - amount leaves.
      local at = last_at_most(b.rest, 2, before + count + weight - pair.amount - 1)
      local offset = rec(b.rest, at and next_rec(b.rest, at) or 1)
      local remaining = pair.amount - count
      if remaining < 0 then remaining = 0 end
      return false, remaining, (b.base + offset + n) * p - now, (b.newest + n) * p - now
    end,

    charge = function(s, pair, now, weight)
      local b = sw_state(s, pair)
      b.stored = nil  -- (changed from here on: no longer the parse of its filed text)
      local p, n, cur = sw_geometry(pair, now)
      sw_trim(b, cur - n)
      if b.rest and b.total + weight >= REBASE_AT and b.c0 >= REBASE_AT / 2 then sw_rebase(b) end
      -- The newest record is rewritten or one appended; the tail fields follow without a parse.
      local total = b.total + weight
      if not b.rest then
        b.base, b.c0, b.rest = cur, 0, '0:' .. fmt(weight)
        b.last, b.colon, b.first_off, b.first_c = 1, 2, 0, weight
      elseif b.newest == cur then
        b.rest = string.sub(b.rest, 1, b.colon) .. fmt(total)
        if b.last == 1 then b.first_c = total end
      else
        local offset = fmt(cur - b.base)
        local last = #b.rest + 2
        b.rest = b.rest .. ',' .. offset .. ':' .. fmt(total)
        b.last, b.colon = last, last + #offset
      end
      b.newest, b.total = cur, total
      sw_store(s, b)
      want_ttl(s, math.ceil(((cur + n) * p - now) / 1000))
    end,

    -- Gives `weight` back. With `at` (the time of the charge being undone) only that bucket
    -- is credited; without it the newest buckets are credited first. Never below zero.
    refund = function(s, pair, now, weight, at)
      local b = sw_state(s, pair)
      b.stored = nil
      local p, n, cur = sw_geometry(pair, now)
      local count = sw_count(b, cur - n)
      if count == 0 then return end
      sw_trim(b, cur - n)  -- every record left is in the window now
      if at then
        local offset = math.floor(at / p) - b.base
        local start = offset >= 0 and last_at_most(b.rest, 1, offset)
        local previous = b.c0
        local prior = start and last_at_most(b.rest, 1, offset - 1)
        if prior then previous = select(2, rec(b.rest, prior)) end
        local c = start and select(2, rec(b.rest, start))
        local take = (start and rec(b.rest, start) == offset) and math.min(weight, c - previous)
                     or 0
        if take < weight and start and math.floor(at / p) > cur - n then
          -- That bucket holds less than the op charged there: a refund (newest first) took
          -- the rest, for weight charged in older buckets. Those give back the difference,
          -- newest first, as the refund would have had the op not been charged.
          sw_spill(b, offset, weight)
          sw_store(s, b)
          want_ttl(s, math.ceil(((cur + n) * p - now) / 1000))
          return
        end
        if take == 0 then return end
        local tail = ''
        local after = next_rec(b.rest, start)
        if after then
          tail = ',' .. string.gsub(string.sub(b.rest, after), '(%d+):(%d+)', function(o, later)
            return o .. ':' .. fmt(tonumber(later) - take)
          end)
        end
        if c - take > previous then
          b.rest = string.sub(b.rest, 1, start - 1) .. fmt(offset) .. ':' .. fmt(c - take) .. tail
        elseif start > 1 then
          b.rest = string.sub(b.rest, 1, start - 2) .. tail
        elseif after then
          b.rest = string.sub(tail, 2)
        else
          b.rest = nil
        end
        sw_tail(b)
      else
        local target = b.total - weight  -- the running total once refunded
        if target < b.c0 then target = b.c0 end
        local keep = last_at_most(b.rest, 2, target)  -- the newest record kept whole
        local previous = b.c0
        if keep then previous = select(2, rec(b.rest, keep)) end
        sw_cut(b, keep and next_rec(b.rest, keep) or 1, target, previous)
      end
      sw_store(s, b)
      want_ttl(s, math.ceil(((cur + n) * p - now) / 1000))
    end,
  }
end
FACTORIES.fw = FACTORIES.sw
