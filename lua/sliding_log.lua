-- aiolimit: sliding log (algorithm code "log"): exact, one ZSET per identifier and period.
--
-- Pair parameters: amount A (integer), period P (integer µs), param unused (0).
-- Aux key: a ZSET "<prefix>:{<id>}:log:<P>"; a request of weight w adds w entries scored by
-- the time (µs) it was admitted, member "<µs>:<sequence>" (the sequence is the main HASH field
-- "q", so members never collide even when time stands still). Entries older than P are
-- removed on every write, so the set never holds more than A entries: memory and CPU are
-- bounded by the limit. The window is (now - P, now]: exact, no buckets.

-- Built on first use in a call (see prelude.lua's algorithm()).
FACTORIES.log = function()
  local ZADD_BATCH = 500  -- keeps unpack() within Lua's C stack

  local function log_window(pair, now)
    return '(' .. fmt(now - pair.period)
  end

  -- The score of the k-th oldest entry still in the window (k >= 1).
  local function log_kth(pair, now, k)
    local hit = redis.call('ZRANGEBYSCORE', pair.aux, log_window(pair, now), '+inf',
                           'WITHSCORES', 'LIMIT', k - 1, 1)
    return tonumber(hit[2])
  end

  local sliding_log = {
    check = function(s, pair, now, weight)
      local count = redis.call('ZCOUNT', pair.aux, log_window(pair, now), '+inf')
      -- Until the newest entry leaves; after a charge that is a whole period, and with weight 0
      -- (the state after a refund) an empty log is full already.
      local reset = 0
      if count + weight <= pair.amount and weight > 0 then
        reset = pair.period
      elseif count > 0 then
        local newest = redis.call('ZRANGE', pair.aux, -1, -1, 'WITHSCORES')
        reset = tonumber(newest[2]) + pair.period - now
      end
      if count + weight <= pair.amount then
        return true, pair.amount - count - weight, 0, reset
      end
      local retry = log_kth(pair, now, count + weight - pair.amount) + pair.period - now
      local remaining = pair.amount - count
      if remaining < 0 then remaining = 0 end
      return false, remaining, retry, reset
    end,

    charge = function(s, pair, now, weight)
      redis.call('ZREMRANGEBYSCORE', pair.aux, '-inf', fmt(now - pair.period))
      local seq = tonumber(s.fields['q']) or 0
      local args = {}
      for i = 1, weight do
        args[#args + 1] = now
        args[#args + 1] = fmt(now) .. ':' .. fmt(seq + i)
        if #args >= 2 * ZADD_BATCH or i == weight then
          redis.call('ZADD', pair.aux, unpack(args))
          args = {}
        end
      end
      stage_set(s, 'q', fmt(seq + weight))
      local ttl = math.ceil(pair.period / 1000) + 1
      want_ttl(s, ttl)
      redis.call('PEXPIRE', pair.aux, ttl + tonumber(ARGV[4]))
    end,

    -- With `at`, removes entries the undone op added (scored at its time); else the newest.
    refund = function(s, pair, now, weight, at)
      local victims
      if at then
        victims = redis.call('ZRANGEBYSCORE', pair.aux, fmt(at), fmt(at), 'LIMIT', 0, weight)
      else
        victims = redis.call('ZRANGE', pair.aux, -weight, -1)
      end
      for i = 1, #victims, ZADD_BATCH do
        redis.call('ZREM', pair.aux, unpack(victims, i, math.min(i + ZADD_BATCH - 1, #victims)))
      end
    end,
  }

  return sliding_log
end
