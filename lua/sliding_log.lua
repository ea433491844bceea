-- aiolimit: sliding log (algorithm code "log"): exact, one ZSET per identifier and period.
--
-- Pair parameters: amount A (integer), period P (integer µs), param unused (0).
-- Aux key: a ZSET "<prefix>:{<id>}:log:<P>" with ONE entry per charge, whatever its weight:
--   score   the time (µs) it was charged; no two entries share one (a charge at the time of
--           the newest entry adds to that entry: units charged at one instant are alike)
--   member  "<c>/<w>": its weight w, and c, the running total charged into the log up to and
--           including it, so c grows with the score. Its units are numbered (c - w, c].
-- Voids: main-hash field "v<P>" = "<lo>:<hi>[:d],..." lists the unit numbers (lo, hi] that were
--   given back but are still in the log (ascending, disjoint, never adjacent, at most VOIDS);
--   ":d" marks a range whose whole entries are still to be deleted. Most calls have none.
-- The window is (now - P, now]: exact, no buckets. The live units are those numbered in
-- (base, N], N = c(newest entry), base = (c - w)(oldest entry scored after now - P), so its
-- weight is N - base minus the voided numbers in (base, N]: two O(log n) lookups plus a walk of
-- the void list. A refusal's retry_after is when the entry holding the (count + weight - A)-th
-- live unit leaves: a binary search on ranks (live units up to an entry grow with rank),
-- O(log² n). So a call costs O(log n + voids) whatever the weight (one ZADD for weight 10^6)
-- and however many entries are live. Writes stay bounded too:
--   charge  adds or updates one entry, drops at most TRIM expired ones (one ZREMRANGEBYSCORE up
--           to the TRIM-th, never the newest entry; expired entries no longer count, so leaving
--           some changes nothing), and deletes at most SWEEP voided ones;
--   refund  (newest first) walks down from N past the voids to the new total y. When at most
--           CUT entries lie above y they go (one ZREMRANGEBYSCORE; the entry holding y is cut
--           to y); past that, (y, N] becomes a void whose entries are deleted SWEEP per call,
--           from the top first (N shrinks with them), so no call frees more than that;
--   undo    (`at`: the time the op charged) credits exactly what that entry still holds. With
--           at most REWRITE later entries (the usual case: the limiter undoes within a round
--           trip) their c are lowered at once; past that (an undo that lands after an outage
--           while others kept charging) the credited numbers become a void: O(log n + voids)
--           instead of a rewrite of every charge made meanwhile.
-- Deleting a voided entry changes no count (its numbers were not counted); deleting the newest
-- ones lowers N, which clips the top void, and a void that ends inside the newest entry is cut
-- from that entry. A void is dropped once its numbers fall to or below base (they left the
-- window). Past VOIDS ranges the lowest is dropped: its units count again until they leave the
-- window (errs toward refusing; it takes VOIDS late undos or large refunds within one period).
-- No call empties the set and then touches it again (see prelude.lua's mark_emptied): an entry
-- is rewritten by adding the new member before removing the old, and the sweep of voided
-- entries keeps the lowest when every entry is voided (it counts nothing and expires).
-- Memory: an entry is added only when the live weight is below A (an admission), or, under
-- count_refused, by a penalty while the window is not over A; once it is, a penalty adds its
-- weight to the newest entry and moves it to now (the count errs on refusing; the op that
-- charged that entry can then no longer be undone). So at most A entries hold live units;
-- voided entries are deleted SWEEP per call, faster than calls can add entries, and expired
-- ones TRIM per charge.

-- Built on first use in a call (see prelude.lua's algorithm()).
FACTORIES.log = function()
  local TRIM = 64  -- expired entries dropped per charge at most
  local REWRITE = 32  -- later entries an undo rewrites at most (past that it voids)
  local CUT = 128  -- entries a refund deletes at once at most (past that it voids)
  local SWEEP = 128  -- voided entries deleted per call at most
  local VOIDS = 64  -- void ranges kept per log at most

  -- {t, c, w, member} of a ZRANGE ... WITHSCORES reply's entry at index i (1-based pairs).
  local function entry(reply, i)
    local member = reply[2 * i - 1]
    if not member then return nil end
    local c, w = string.match(member, '^(%d+)/(%d+)$')
    return {t = tonumber(reply[2 * i]), c = tonumber(c), w = tonumber(w), member = member}
  end

  local function at_rank(pair, rank)
    return entry(redis.call('ZRANGE', pair.aux, rank, rank, 'WITHSCORES'), 1)
  end

  local function after(t)  -- a range bound excluding t
    return '(' .. fmt(t)
  end

  local function size_of(pair)
    return redis.call('ZCOUNT', pair.aux, '-inf', '+inf')
  end

  local function live_of(pair, now)
    return redis.call('ZCOUNT', pair.aux, after(now - pair.period), '+inf')
  end

  -- The lowest rank within [lo, hi] whose entry passes `test` (monotone in rank); the entry at
  -- `hi` must pass it.
  local function first_where(pair, lo, hi, test)
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if test(at_rank(pair, mid)) then hi = mid else lo = mid + 1 end
    end
    return lo
  end

  local function put(pair, t, c, w)
    redis.call('ZADD', pair.aux, fmt(t), fmt(c) .. '/' .. fmt(w))
  end

  local function void_field(pair)
    local spec = pair.spec
    local name = spec.void_field
    if not name then
      name = 'v' .. pair.period_s
      spec.void_field = name
    end
    return name
  end

  local function voids_of(s, pair)
    local list = {}
    local raw = read_field(s, void_field(pair))
    if raw then
      for lo, hi, d in string.gmatch(raw, '(%d+):(%d+)(:?d?)') do
        list[#list + 1] = {lo = tonumber(lo), hi = tonumber(hi), dirty = d == ':d'}
      end
    end
    return list
  end

  local function voids_save(s, pair, list)
    while #list > VOIDS do table.remove(list, 1) end  -- the lowest count again (see header)
    if #list == 0 then
      stage_del(s, void_field(pair))
      return
    end
    local parts = {}
    for i, v in ipairs(list) do
      parts[i] = fmt(v.lo) .. ':' .. fmt(v.hi) .. (v.dirty and ':d' or '')
    end
    stage_set(s, void_field(pair), table.concat(parts, ','))
    want_ttl(s, math.ceil(pair.period / 1000) + 1)
  end

  -- Voided numbers within (a, b].
  local function voided(list, a, b)
    local n = 0
    for _, v in ipairs(list) do
      local lo, hi = math.max(v.lo, a), math.min(v.hi, b)
      if hi > lo then n = n + hi - lo end
    end
    return n
  end

  -- Adds the numbers (lo, hi] (none of them voided yet) to the list, merging neighbours.
  local function void_add(list, lo, hi, dirty)
    local i = 1
    while i <= #list and list[i].hi <= lo do i = i + 1 end
    table.insert(list, i, {lo = lo, hi = hi, dirty = dirty})
    local v = list[i]
    if i > 1 and list[i - 1].hi == v.lo then
      list[i - 1].hi = v.hi
      list[i - 1].dirty = list[i - 1].dirty or v.dirty
      table.remove(list, i)
      i = i - 1
      v = list[i]
    end
    if list[i + 1] and list[i + 1].lo == v.hi then
      v.hi = list[i + 1].hi
      v.dirty = v.dirty or list[i + 1].dirty
      table.remove(list, i + 1)
    end
  end

  -- Live weight in the window, base, and the newest entry (nil when the log is empty).
  -- `newest`: the newest entry when the caller has it already.
  local function log_count(pair, now, list, newest)
    if is_emptied(pair.aux) then return 0, 0, nil end
    newest = newest or at_rank(pair, -1)
    if not newest then return 0, 0, nil end
    if newest.t <= now - pair.period then return 0, newest.c, newest end
    local oldest = entry(redis.call('ZRANGEBYSCORE', pair.aux, after(now - pair.period), '+inf',
                                    'WITHSCORES', 'LIMIT', 0, 1), 1)
    local base = oldest.c - oldest.w
    return newest.c - base - voided(list, base, newest.c), base, newest
  end

  -- When the newest live unit was charged (the log holds live units).
  local function newest_live_t(pair, now, list, newest)
    local top = list[#list]
    if not top or top.hi < newest.c then return newest.t end
    local rank = first_where(pair, -live_of(pair, now), -1,
                             function(e) return e.c >= top.lo end)
    return at_rank(pair, rank).t
  end

  -- Drops voids that left the window, deletes voided entries (at most SWEEP) and settles the
  -- top: a void ending in the newest entry is cut from it, whole voided entries there deleted.
  local function tidy(pair, now, list)
    local _, base, newest = log_count(pair, now, list)
    if not newest then return {} end
    local kept = {}
    for _, v in ipairs(list) do
      if v.hi > base then kept[#kept + 1] = v end
    end
    list = kept
    local budget = SWEEP
    while #list > 0 do
      local v = list[#list]
      newest = at_rank(pair, -1)
      if not newest then return {} end
      if v.hi > newest.c then v.hi = newest.c end
      if v.hi <= v.lo then
        table.remove(list)
      elseif v.hi < newest.c then
        break
      elseif v.lo > newest.c - newest.w then
        -- (the cut entry is added before the whole one goes: the set never empties)
        put(pair, newest.t, v.lo, newest.w - (newest.c - v.lo))
        redis.call('ZREM', pair.aux, newest.member)
        table.remove(list)
        break
      else
        if budget == 0 then break end
        local size = size_of(pair)
        local rank = first_where(pair, -size, -1, function(e) return e.c - e.w >= v.lo end)
        if rank <= -size then
          -- Every entry is voided: the lowest stays (it counts nothing, and leaves with the
          -- window), so the set this call goes on writing is never emptied.
          if size == 1 then break end
          rank = 1 - size
        end
        if -rank > budget then rank = -budget end
        budget = budget + rank
        redis.call('ZREMRANGEBYSCORE', pair.aux, fmt(at_rank(pair, rank).t), '+inf')
      end
    end
    for _, v in ipairs(list) do
      if v.dirty then
        if budget > 0 then
          -- whole entries inside (lo, hi]: from the first with c - w >= lo to the last c <= hi
          local size = size_of(pair)
          local first = first_where(pair, 0, size - 1, function(e) return e.c - e.w >= v.lo end)
          local beyond = first_where(pair, 0, size, function(e) return e.c > v.hi end)
          local e = at_rank(pair, first)
          local last = math.min(beyond - 1, first + budget - 1)
          if first == 0 and last >= size - 1 then last = size - 2 end  -- never empty it
          if e.c - e.w < v.lo or first > last then
            v.dirty = false  -- no whole entry left inside that may go
          else
            redis.call('ZREMRANGEBYSCORE', pair.aux, fmt(e.t), fmt(at_rank(pair, last).t))
            if last == beyond - 1 then v.dirty = false end
          end
        end
        break
      end
    end
    return list
  end

  local log = {
    field = void_field,

    check = function(s, pair, now, weight)
      local list = voids_of(s, pair)
      local count, base, newest = log_count(pair, now, list)
      -- Until the newest live unit leaves; after a charge that is a whole period, and with
      -- weight 0 (the state after a refund) an empty log is full already.
      local reset = 0
      if count + weight <= pair.amount and weight > 0 then
        reset = pair.period
      elseif count > 0 then
        reset = newest_live_t(pair, now, list, newest) + pair.period - now
      end
      if count + weight <= pair.amount then
        return true, pair.amount - count - weight, 0, reset
      end
      -- Enough units leave when the entry holding live unit number (count + weight - A) does.
      local target = count + weight - pair.amount
      local rank = first_where(pair, -live_of(pair, now), -1, function(e)
        return e.c - base - voided(list, base, e.c) >= target
      end)
      local remaining = pair.amount - count
      if remaining < 0 then remaining = 0 end
      return false, remaining, at_rank(pair, rank).t + pair.period - now, reset
    end,

    charge = function(s, pair, now, weight, op, reserving, penalty)
      -- Expired entries go, at most TRIM of them, and never the newest: the set is written
      -- next, so the trim must not empty it (an expired newest entry counts nothing).
      local newest = at_rank(pair, -1)
      if newest then
        local cut = now - pair.period
        local far = redis.call('ZRANGEBYSCORE', pair.aux, '-inf', fmt(cut), 'WITHSCORES',
                               'LIMIT', TRIM - 1, 1)
        local bound = far[2] or fmt(cut)
        if newest.t <= (tonumber(far[2]) or cut) then bound = after(newest.t) end
        redis.call('ZREMRANGEBYSCORE', pair.aux, '-inf', bound)
      end
      local list = voids_of(s, pair)
      local had = #list > 0
      if had then
        list = tidy(pair, now, list)
        newest = nil  -- (tidy may have changed it)
      end
      local count, _
      count, _, newest = log_count(pair, now, list, newest)
      local c = newest and newest.c or 0
      if newest and (newest.t == now or (penalty and count >= pair.amount)) then
        -- Rewritten in place: the new member is added before the old one goes.
        local member = fmt(c + weight) .. '/' .. fmt(newest.w + weight)
        redis.call('ZADD', pair.aux, fmt(now), member)
        if member ~= newest.member then redis.call('ZREM', pair.aux, newest.member) end
      else
        put(pair, now, c + weight, weight)
      end
      local ttl = math.ceil(pair.period / 1000) + 1
      want_ttl(s, ttl)
      redis.call('PEXPIRE', pair.aux, ttl + CALL.slack)
      if had then voids_save(s, pair, list) end
    end,

    -- Without `at`: the newest units first, never below zero. With `at` (undo): only what
    -- the entry charged at that time still holds, if it still counts.
    refund = function(s, pair, now, weight, at)
      local list = voids_of(s, pair)
      if at then
        if at <= now - pair.period then return end  -- it left the window: nothing counts
        local e = entry(redis.call('ZRANGEBYSCORE', pair.aux, fmt(at), fmt(at), 'WITHSCORES'), 1)
        if not e then return end
        local bottom = e.c - e.w
        local take = math.min(weight, e.w - voided(list, bottom, e.c))
        if take <= 0 then return end
        local above = #list > 0 and list[#list].hi > bottom
        local later = redis.call('ZRANGEBYSCORE', pair.aux, after(at), '+inf',
                                 'WITHSCORES', 'LIMIT', 0, REWRITE + 1)
        if not above and #later <= 2 * REWRITE then
          -- Lower c of the few entries charged after it (no void lies at or above it). The
          -- new members are added first (one may be an old member's name: ZADD moves it, and
          -- it is not removed), so the set empties only when e was its one entry.
          local back, written = {}, {}
          local function write(t, c, w)
            local member = fmt(c) .. '/' .. fmt(w)
            back[#back + 1] = fmt(t)
            back[#back + 1] = member
            written[member] = true
          end
          if e.w > take then write(e.t, e.c - take, e.w - take) end
          local gone = {}
          local entries = {e}
          for i = 1, #later / 2 do
            local l = entry(later, i)
            entries[#entries + 1] = l
            write(l.t, l.c - take, l.w)
          end
          for _, x in ipairs(entries) do
            if not written[x.member] then gone[#gone + 1] = x.member end
          end
          if #back > 0 then
            redis.call('ZADD', pair.aux, unpack(back))
            if #gone > 0 then redis.call('ZREM', pair.aux, unpack(gone)) end
          else
            local alone = at_rank(pair, 0).member == e.member  -- (nothing follows e)
            redis.call('ZREM', pair.aux, e.member)
            if alone then mark_emptied(pair.aux) end
          end
          return
        end
        -- Void `take` of its numbers, the highest unvoided first.
        local y = e.c
        while take > 0 do
          local floor_ = bottom
          for i = #list, 1, -1 do
            local v = list[i]
            if v.lo < y and v.hi >= y then y = v.lo end
            if v.hi < y then
              if v.hi > floor_ then floor_ = v.hi end
              break
            end
          end
          local n = math.min(take, y - floor_)
          if n <= 0 then break end
          void_add(list, y - n, y, false)
          take = take - n
          y = y - n
        end
        voids_save(s, pair, tidy(pair, now, list))
        return
      end
      if weight <= 0 then return end  -- (nothing to give back; y would be newest.c)
      local newest = at_rank(pair, -1)
      if not newest then return end
      -- The running total once `weight` unvoided units are taken from the top.
      local y, left, first_above = newest.c, weight, #list + 1
      for i = #list, 1, -1 do
        local v = list[i]
        if y - v.hi >= left then break end
        left = left - (y - v.hi)
        y = v.lo
        first_above = i
      end
      y = y - left
      local oldest = at_rank(pair, 0)
      if y <= oldest.c - oldest.w then
        -- All of it: UNLINK frees a large set off the main thread (DEL took ~0.3 µs an entry).
        redis.call('UNLINK', pair.aux)
        mark_emptied(pair.aux)
        stage_del(s, void_field(pair))
        return
      end
      local below = {}
      for i = 1, first_above - 1 do below[i] = list[i] end
      -- The entry holding unit number y + 1, and how many entries from it up.
      local rank = first_where(pair, -size_of(pair), -1, function(e) return e.c > y end)
      if -rank <= CUT then
        local e = at_rank(pair, rank)
        local kept = y - (e.c - e.w)
        if kept > 0 then
          -- e cut to y: added before e and those above go, so the set never empties.
          put(pair, e.t, y, kept)
          redis.call('ZREM', pair.aux, e.member)
          redis.call('ZREMRANGEBYSCORE', pair.aux, after(e.t), '+inf')
        else
          -- (e is not the oldest entry, whose bottom is below y: the set keeps that one)
          redis.call('ZREMRANGEBYSCORE', pair.aux, fmt(e.t), '+inf')
        end
        voids_save(s, pair, below)
        return
      end
      void_add(below, y, newest.c, true)
      voids_save(s, pair, tidy(pair, now, below))
    end,
  }

  -- Entries re-added after the set emptied (an undo rewriting those after its own) make a
  -- new key, which needs its TTL again.
  local refund_entries = log.refund
  log.refund = function(s, pair, now, weight, at)
    refund_entries(s, pair, now, weight, at)
    if not is_emptied(pair.aux) then
      redis.call('PEXPIRE', pair.aux, math.ceil(pair.period / 1000) + 1 + CALL.slack)
    end
  end
  return log
end
