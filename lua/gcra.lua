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
-- A reservation also stores its TAT as a floor (";<tat>:<frac>:<op id>" after the state, kept
-- while it is in the future): a refund never moves the TAT below it, else a newcomer could
-- be given a turn the reserved waiter already holds (two through at one instant). Only the
-- undo of that very reservation (its op id) lowers the floor, by what it charged.

-- Built on first use in a call (see prelude.lua's algorithm()).
FACTORIES.gcra = function()
  -- Exact floor(a / b) for integers held in doubles (the quotient may round across an integer).
  local function idiv(a, b)
    local q = math.floor(a / b)
    local r = a - q * b
    if r < 0 then q = q - 1 elseif r >= b then q = q + 1 end
    return q, a - q * b
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

  -- The state: TAT, and the floor a refund may not cross (nil when none is pending).
  local function gcra_state(s, pair, now)
    local name = 'g' .. pair.period_s .. '/' .. pair.param_s .. '/' .. fmt(pair.amount)
    local tat, frac, floor = now, 0, nil
    local raw = s.fields[name]
    if raw then
      local a, b, rest = string.match(raw, '^(%-?%d+):(%d+)(.*)$')
      local t, f = tonumber(a), tonumber(b)
      if t and (t > now or (t == now and f > 0)) then tat, frac = t, f end
      local ft, ff, fop = string.match(rest or '', '^;(%-?%d+):(%d+):([^;]*)$')
      ft, ff = tonumber(ft), tonumber(ff)
      if ft and (ft > now or (ft == now and ff > 0)) then floor = {ft, ff, fop} end
    end
    return name, tat, frac, floor
  end

  local function gcra_store(s, pair, now, name, tat, frac, floor)
    local value = fmt(tat) .. ':' .. fmt(frac)
    if floor then
      value = value .. ';' .. fmt(floor[1]) .. ':' .. fmt(floor[2]) .. ':' .. floor[3]
    end
    stage_set(s, name, value)
    want_ttl(s, math.ceil(gcra_us(pair, (tat - now) * pair.param + frac) / 1000) + 1)
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

    charge = function(s, pair, now, weight, op, reserving)
      local name, tat, frac, floor = gcra_state(s, pair, now)
      tat, frac = gcra_shift(pair, tat, frac, weight)
      if reserving and (tat - now) * pair.param + frac > pair.amount * pair.period then
        floor = {tat, frac, op}  -- a reserved turn: no refund may hand it out again
      end
      gcra_store(s, pair, now, name, tat, frac, floor)
    end,

    -- Gives `weight` back, never below now nor below the floor: while a turn is reserved the
    -- TAT stays at or after the latest reservation's, so a newcomer queues after that turn.
    -- Undoing (`at` given) the reservation that set the floor lowers the floor with it.
    refund = function(s, pair, now, weight, at, op)
      local name, tat, frac, floor = gcra_state(s, pair, now)
      if tat == now and frac == 0 then return end  -- already full
      if floor and at and op ~= '' and floor[3] == op then
        local ft, ff = gcra_shift(pair, floor[1], floor[2], -weight)
        floor = nil
        if ft > now or (ft == now and ff > 0) then floor = {ft, ff, ''} end
      end
      tat, frac = gcra_shift(pair, tat, frac, -weight)
      if tat < now then tat, frac = now, 0 end
      if floor and (tat < floor[1] or (tat == floor[1] and frac < floor[2])) then
        tat, frac = floor[1], floor[2]
      end
      gcra_store(s, pair, now, name, tat, frac, floor)
    end,
  }

  return gcra
end
