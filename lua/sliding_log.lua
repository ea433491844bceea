-- aiolimit: sliding log (algorithm code "log"): exact, one ZSET per identifier and period.
--
-- Pair parameters: amount A (integer), period P (integer µs), param unused (0).
-- Aux key: a ZSET "<prefix>:{<id>}:log:<P>" with ONE entry per charge, whatever its weight:
--   score   the time (µs) it was charged; no two entries share one (a charge at the time of
--           the newest entry adds to that entry: units charged at one instant are alike)
--   member  "<c>/<w>": its weight w, and c, the running total charged into the log up to and
--           including it, so c grows with the score.
-- The window is (now - P, now]: exact, no buckets. Its weight is
--   c(newest entry) - (c - w)(oldest entry scored after now - P)
-- two O(log n) lookups (ZRANGE -1 -1, ZRANGEBYSCORE ... LIMIT 0 1). A refusal's retry_after is
-- when the entry holding the (count + weight - A)-th live unit leaves: found by binary search
-- on ranks among the live entries (c grows with rank), O(log² n). So a call costs O(log n)
-- whatever the weight (one ZADD for weight 10^6) and however many entries are live.
-- Writes stay bounded too:
--   charge  adds or updates one entry, and drops at most TRIM expired ones (one
--           ZREMRANGEBYSCORE up to the TRIM-th; expired entries no longer count, so leaving
--           some behind changes nothing);
--   refund  (newest first) finds by binary search the entry holding the new total, cuts it,
--           and drops everything newer with one ZREMRANGEBYSCORE (or DEL when nothing stays).
--           Redis frees those m entries natively, ~0.1-0.3 µs each: the one cost here that
--           grows, with the weight refunded (m <= weight), not with the calls' history;
--   undo    (`at`: the time the op charged) credits exactly that entry, then lowers c of the
--           k entries charged after it: O(log n + k). The limiter undoes within a round trip
--           of the op (compensation, a cancelled lease), so k is the few charges in between.
-- Memory: at most A entries. An entry is added only when the live weight is below A (an
-- admission), or, under count_refused, by a penalty while the window is not over A; once it
-- is, a penalty adds its weight to the newest entry and moves it to now (the count errs on
-- refusing; the op that charged that entry can then no longer be undone). So the N live
-- entries were live, each of weight >= 1, when the newest was added: N - 1 < A. A charge
-- that finds expired entries removes at least one, so expired ones never push the set past A.

-- Built on first use in a call (see prelude.lua's algorithm()).
FACTORIES.log = function()
  local TRIM = 64  -- expired entries dropped per charge at most

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

  -- Weight in the window, the total charged before its oldest live entry, and the newest
  -- entry (nil when the log is empty).
  local function log_count(pair, now)
    local newest = at_rank(pair, -1)
    if not newest or newest.t <= now - pair.period then return 0, 0, newest end
    local oldest = entry(redis.call('ZRANGEBYSCORE', pair.aux, after(now - pair.period), '+inf',
                                    'WITHSCORES', 'LIMIT', 0, 1), 1)
    local base = oldest.c - oldest.w
    return newest.c - base, base, newest
  end

  -- The entry of lowest rank within [lo, hi] (negative ranks) whose c reaches `target`; the
  -- entry at `hi` must reach it.
  local function first_reaching(pair, lo, hi, target)
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if at_rank(pair, mid).c >= target then hi = mid else lo = mid + 1 end
    end
    return at_rank(pair, lo)
  end

  local function put(pair, t, c, w)
    redis.call('ZADD', pair.aux, fmt(t), fmt(c) .. '/' .. fmt(w))
  end

  local log = {
    check = function(s, pair, now, weight)
      local count, base, newest = log_count(pair, now)
      -- Until the newest entry leaves; after a charge that is a whole period, and with weight 0
      -- (the state after a refund) an empty log is full already.
      local reset = 0
      if count + weight <= pair.amount and weight > 0 then
        reset = pair.period
      elseif count > 0 then
        reset = newest.t + pair.period - now
      end
      if count + weight <= pair.amount then
        return true, pair.amount - count - weight, 0, reset
      end
      -- Enough units leave when the entry holding unit number (count + weight - A) does.
      local live = redis.call('ZCOUNT', pair.aux, after(now - pair.period), '+inf')
      local e = first_reaching(pair, -live, -1, base + count + weight - pair.amount)
      local remaining = pair.amount - count
      if remaining < 0 then remaining = 0 end
      return false, remaining, e.t + pair.period - now, reset
    end,

    charge = function(s, pair, now, weight, op, reserving, penalty)
      local cut = now - pair.period
      local far = redis.call('ZRANGEBYSCORE', pair.aux, '-inf', fmt(cut), 'WITHSCORES',
                             'LIMIT', TRIM - 1, 1)
      redis.call('ZREMRANGEBYSCORE', pair.aux, '-inf', far[2] or fmt(cut))
      local count, _, newest = log_count(pair, now)
      local c = newest and newest.c or 0
      if newest and (newest.t == now or (penalty and count >= pair.amount)) then
        redis.call('ZREM', pair.aux, newest.member)
        put(pair, now, c + weight, newest.w + weight)
      else
        put(pair, now, c + weight, weight)
      end
      local ttl = math.ceil(pair.period / 1000) + 1
      want_ttl(s, ttl)
      redis.call('PEXPIRE', pair.aux, ttl + CALL.slack)
    end,

    -- Without `at`: the newest units first, never below zero. With `at` (undo): only what
    -- the entry charged at that time holds, if it still counts.
    refund = function(s, pair, now, weight, at)
      if at then
        if at <= now - pair.period then return end  -- it left the window: nothing counts
        local e = entry(redis.call('ZRANGEBYSCORE', pair.aux, fmt(at), fmt(at), 'WITHSCORES'), 1)
        if not e then return end
        local take = math.min(weight, e.w)
        local later = redis.call('ZRANGEBYSCORE', pair.aux, after(at), '+inf',
                                 'WITHSCORES')
        local gone, back = {e.member}, {}
        if e.w > take then back = {fmt(e.t), fmt(e.c - take) .. '/' .. fmt(e.w - take)} end
        for i = 1, #later / 2 do
          local l = entry(later, i)
          gone[#gone + 1] = l.member
          back[#back + 1] = fmt(l.t)
          back[#back + 1] = fmt(l.c - take) .. '/' .. fmt(l.w)
        end
        call_batched('ZREM', pair.aux, nil, gone)
        call_batched('ZADD', pair.aux, nil, back)
        return
      end
      local newest = at_rank(pair, -1)
      if not newest then return end
      local size = redis.call('ZCOUNT', pair.aux, '-inf', '+inf')
      local oldest = at_rank(pair, 0)
      local target = newest.c - weight  -- the running total once refunded
      if target <= oldest.c - oldest.w then
        redis.call('DEL', pair.aux)  -- all of it: cheaper than removing entries one by one
        return
      end
      -- The entry holding unit number target + 1 is cut; everything newer goes.
      local e = first_reaching(pair, -size, -1, target + 1)
      redis.call('ZREMRANGEBYSCORE', pair.aux, fmt(e.t), '+inf')
      local kept = target - (e.c - e.w)
      if kept > 0 then put(pair, e.t, target, kept) end
    end,
  }

  -- Entries re-added after the set emptied (an undo rewriting those after its own) make a
  -- new key, which needs its TTL again.
  local refund_entries = log.refund
  log.refund = function(s, pair, now, weight, at)
    refund_entries(s, pair, now, weight, at)
    redis.call('PEXPIRE', pair.aux, math.ceil(pair.period / 1000) + 1 + CALL.slack)
  end
  return log
end
