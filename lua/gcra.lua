-- aiolimit: GCRA token bucket (algorithm code "gcra"); with burst 1 it is a minimum interval.
--
-- Pair parameters: amount = burst B (the bucket's capacity, integer >= 1), period = P
-- (integer µs), param = rate R (integer >= 1): R units refill every P µs, one unit every
-- T = P / R µs. No aux key.
-- State: one theoretical arrival time TAT = tat + frac / R µs, kept as an exact rational so
-- fractional refill never drifts over long runs; main HASH field "g<P>/<R>/<B>" = "<tat>:<frac>"
-- with 0 <= frac < R. The bucket is full when TAT <= now.
-- A request of weight w is admitted when max(TAT, now) + w*T - now <= B*T. All comparisons are
-- made on values scaled by R (integers); the client keeps (B + w) * P below 2^53.
-- Reserving (decide.lua's max wait W > 0): a request that would be admitted within W µs is
-- charged now and admitted after a delay, reported as retry_after on an allowed pair: waiters
-- queue in arrival order instead of retrying together.

-- Built on first use in a call (see prelude.lua's algorithm()).
FACTORIES.gcra = function()
  -- Exact floor(a / b) for integers held in doubles (the quotient may round across an integer).
  local function idiv(a, b)
    local q = math.floor(a / b)
    local r = a - q * b
    if r < 0 then q = q - 1 elseif r >= b then q = q + 1 end
    return q, a - q * b
  end

  local function gcra_state(s, pair, now)
    local name = 'g' .. pair.period_s .. '/' .. pair.param_s .. '/' .. fmt(pair.amount)
    local tat, frac = now, 0
    local raw = s.fields[name]
    if raw then
      local a, b = string.match(raw, '^(%-?%d+):(%d+)$')
      local t, f = tonumber(a), tonumber(b)
      if t and (t > now or (t == now and f > 0)) then tat, frac = t, f end
    end
    return name, tat, frac
  end

  local function gcra_shift(pair, tat, frac, units)
    local whole, rest = idiv(frac + units * pair.period, pair.param)
    return tat + whole, rest
  end

  -- Microseconds (rounded up) for a span given scaled by R.
  local function gcra_us(pair, scaled)
    if scaled <= 0 then return 0 end
    local q, r = idiv(scaled, pair.param)
    if r > 0 then q = q + 1 end
    return q
  end

  local gcra = {
    check = function(s, pair, now, weight, max_wait)
      local _, tat, frac = gcra_state(s, pair, now)
      local capacity = pair.amount * pair.period  -- B * T, scaled by R
      local new_tat, new_frac = gcra_shift(pair, tat, frac, weight)
      local excess = (new_tat - now) * pair.param + new_frac
      local delay = gcra_us(pair, excess - capacity)
      if excess <= capacity or (max_wait > 0 and delay <= max_wait) then
        local remaining = math.floor((capacity - excess) / pair.period)
        if remaining < 0 then remaining = 0 end
        return true, remaining, delay, gcra_us(pair, excess)
      end
      local held = (tat - now) * pair.param + frac
      return false, math.floor((capacity - held) / pair.period), delay, gcra_us(pair, held)
    end,

    charge = function(s, pair, now, weight)
      local name, tat, frac = gcra_state(s, pair, now)
      tat, frac = gcra_shift(pair, tat, frac, weight)
      stage_set(s, name, fmt(tat) .. ':' .. fmt(frac))
      want_ttl(s, math.ceil(gcra_us(pair, (tat - now) * pair.param + frac) / 1000) + 1)
    end,

    refund = function(s, pair, now, weight)
      local name, tat, frac = gcra_state(s, pair, now)
      if tat == now and frac == 0 then return end  -- already full
      tat, frac = gcra_shift(pair, tat, frac, -weight)
      if tat < now then tat, frac = now, 0 end
      stage_set(s, name, fmt(tat) .. ':' .. fmt(frac))
      want_ttl(s, math.ceil(gcra_us(pair, (tat - now) * pair.param + frac) / 1000) + 1)
    end,
  }

  return gcra
end
