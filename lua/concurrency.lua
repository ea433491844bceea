-- aiolimit: concurrency leases (algorithm code "lease"): at most A in flight per identifier.
--
-- Pair parameters: amount A (integer), period = lease TTL L (integer µs), param unused (0).
-- Aux key: a ZSET "<prefix>:{<id>}:lease" of lease units, member "<op id>:<i>" for i = 1..w,
-- scored by the time (µs) the lease expires. A holder that dies is released when its lease
-- expires; live holders renew ("renew" mode) and release ("release" mode) by op id.
-- retry_after is when enough leases expire at the latest (holders usually release sooner).
-- Acquiring needs an op id (decide.lua refuses the call before any write without one). Under
-- count_refused a refused call takes no lease: the penalty is for rate limits, not slots.

-- Built on first use in a call (see prelude.lua's algorithm()).
FACTORIES.lease = function()
  local function lease_live(pair, now)
    return redis.call('ZCOUNT', pair.aux, '(' .. fmt(now), '+inf')
  end

  local function lease_members(op, weight)
    local members = {}
    for i = 1, weight do members[i] = op .. ':' .. fmt(i) end
    return members
  end

  -- Drops the op's leases. The set is never emptied: while its slot is migrating, Redis
  -- answers a call naming one key it holds and one it holds nowhere TRYAGAIN (on both
  -- nodes), so an idle identifier whose lease set was deleted with its main key still there
  -- could not be decided until the slot was assigned. A drop that may take the last
  -- members first adds PLACEHOLDER, scored -inf: never live, never an op's member, and
  -- trimmed as an expired lease once a charge has added its own. The set expires with its
  -- main key (decide.lua's mirror_leases raises its expiry to the main key's on every write
  -- of the main key).
  local PLACEHOLDER = '~'
  local function drop(pair, op, weight)
    local members = lease_members(op, weight)
    local size = redis.call('ZCOUNT', pair.aux, '-inf', '+inf')
    if size == 0 then return end  -- (no set: nothing to drop)
    if size <= #members then redis.call('ZADD', pair.aux, '-inf', PLACEHOLDER) end
    for i = 1, #members, BATCH do
      redis.call('ZREM', pair.aux, unpack(members, i, math.min(i + BATCH - 1, #members)))
    end
  end

  local leases = {
    -- count_refused's penalty charges rate limits only: a refused call holds no slot.
    penalty_free = true,

    check = function(s, pair, now, weight)
      local count = 0
      if not is_emptied(pair.aux) then count = lease_live(pair, now) end
      local reset = 0
      if count > 0 then
        local newest = redis.call('ZRANGE', pair.aux, -1, -1, 'WITHSCORES')
        reset = tonumber(newest[2]) - now
      end
      if count + weight <= pair.amount then
        if weight > 0 and reset < pair.period then reset = pair.period end
        return true, pair.amount - count - weight, 0, reset
      end
      local hit = redis.call('ZRANGEBYSCORE', pair.aux, '(' .. fmt(now), '+inf', 'WITHSCORES',
                             'LIMIT', count + weight - pair.amount - 1, 1)
      return false, pair.amount - count, tonumber(hit[2]) - now, reset
    end,

    charge = function(s, pair, now, weight, op)
      if weight == 0 then return end  -- (takes no lease)
      local expires = fmt(now + pair.period)
      local args = {}
      for _, member in ipairs(lease_members(op, weight)) do
        args[#args + 1] = expires
        args[#args + 1] = member
      end
      call_batched('ZADD', pair.aux, nil, args)
      -- Expired leases go after the new ones are in (they expire later): never empty.
      redis.call('ZREMRANGEBYSCORE', pair.aux, '-inf', fmt(now))
      want_ttl(s, math.ceil(pair.period / 1000) + 1)
      local ttl = redis.call('PTTL', pair.aux)
      local want = math.ceil(pair.period / 1000) + 1 + CALL.slack
      if ttl < want then redis.call('PEXPIRE', pair.aux, want) end
    end,

    -- A plain refund cannot tell whose lease to drop: only undo and release remove leases.
    refund = function(s, pair, now, weight, at, op)
      if op ~= '' and at then drop(pair, op, weight) end
    end,

    release = function(s, pair, now, weight, op)
      drop(pair, op, weight)
    end,

    -- Whether the op's leases are still live (all of an op's units share one expiry).
    held = function(pair, now, op)
      local score = redis.call('ZSCORE', pair.aux, op .. ':1')
      return score ~= false and score ~= nil and tonumber(score) > now
    end,

    renew = function(s, pair, now, weight, op)
      local expires = fmt(now + pair.period)
      local args = {}
      for _, member in ipairs(lease_members(op, weight)) do
        args[#args + 1] = expires
        args[#args + 1] = member
      end
      call_batched('ZADD', pair.aux, 'XX', args)
      local want = math.ceil(pair.period / 1000) + 1 + CALL.slack
      if redis.call('PTTL', pair.aux) < want then redis.call('PEXPIRE', pair.aux, want) end
      want_ttl(s, math.ceil(pair.period / 1000) + 1)
      -- The main key is written too (its "t"), so flush extends its TTL with the set's and
      -- mirror_leases gives the set that TTL: a set outliving its main key is one present
      -- and one absent key, TRYAGAIN while the slot migrates (see drop).
      s.dirty = true
    end,
  }

  return leases
end
