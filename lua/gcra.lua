-- aiolimit: GCRA token bucket (algorithm code "gcra"); with burst 1 it is a minimum interval.
--
-- Pair parameters: amount = burst B (the bucket's capacity, integer >= 1), period = P
-- (integer µs), param = rate R (integer >= 1): R units refill every P µs, one unit every
-- T = P / R µs. No aux key.
-- Virtual scheduling: every admitted unit holds a slot of length T on a virtual timeline; a
-- request of weight w charged at `now` takes [vs, vend), vs >= now, vend = vs + w*T, and is
-- admitted at max(now, vend - B*T). While slots never overlap, each starts at or after its
-- charge and none is admitted before vend - B*T, any interval [a, b] admits at most
-- (b - a)/T + B units: the slots of the units admitted in it lie within [a, b + B*T].
-- State: main HASH field "g<P>/<R>/<B>" = "<tat>:<frac>[;<item>...]". TAT = tat + frac/R µs,
-- an exact rational (0 <= frac < R), ends the last slot; the bucket is full when TAT <= now.
-- A request of weight w is admitted when max(TAT, now) + w*T - now <= B*T. All arithmetic is
-- on times as offsets from now scaled by R (integers); the client keeps (B + w) * P below 2^53.
-- Reserving (decide.lua's max wait W > 0): a request that would be admitted within W µs is
-- charged now and admitted after a delay, reported as retry_after on an allowed pair: waiters
-- queue in arrival order instead of retrying together.
-- Items (none in the common case; each time written as "<tat>:<frac>"):
--   r<vend>:<w>:<op>   a recorded turn: a reservation, or a request that took a hole (at most
--                      TURNS, kept while its slot lies ahead). The latest turn's vend is a
--                      floor: a refund never moves TAT below it, else a newcomer could share
--                      a turn a waiter holds.
--   h<start>:<end>     a hole: a free span below TAT, left by an undone turn (at most HOLES,
--                      kept while it ends ahead). A request takes the earliest hole it fits
--                      in, from max(start, now); a hole's capacity that time passes is gone,
--                      as a full bucket's is.
--   f<end>             the end of turns no longer recorded (past TURNS): a floor as well.
--   m<w>:<op>          the last request admitted at once, whose slot ends at TAT; written as
--   l<end>:<w>:<op>    once later charges moved TAT past its end.
-- Undoing an op (`at` and `op` given) frees exactly the slot it holds: a recorded turn's, or
-- the last immediate admission's (a hole, or the tail when it is the last slot), the part
-- still ahead of now. An op admitted at once before others were charged is not known where
-- its slot lies, so its undo credits nothing (errs toward refusing: it stays charged until its
-- slot passes, at most B*T). Crediting it from the tail instead, as the single-TAT code did,
-- moves later slots before their own charge: a fuzzer found it admitting too much. A refund
-- (no `at`) gives back from the tail, never below the last queued turn.

-- A bucket is full when TAT <= now; every item it records (turns, holes, floors, the last
-- admission) lies at or below TAT, so in the past then (see STALE in prelude.lua).
STALE[103] = function(name, value, now)  -- 'g'
  local rate = tonumber(string.match(name, '^g%d+/(%d+)/%d+$'))
  local tat, frac = string.match(value, '^(%-?%d+):(%d+)')
  if not rate or not tat then return false end
  return (tonumber(tat) - now) * rate + tonumber(frac) <= 0
end

-- Built on first use in a call (see prelude.lua's algorithm()).
FACTORIES.gcra = function()
  local TURNS, HOLES = 16, 16

  -- The limit's field name, made once per spec.
  local function gcra_field(pair)
    local spec = pair.spec
    local name = spec.gcra_field
    if not name then
      name = 'g' .. pair.period_s .. '/' .. pair.param_s .. '/' .. fmt(pair.amount)
      spec.gcra_field = name
    end
    return name
  end

  -- Exact floor(a / b) for integers held in doubles (the quotient may round across an integer).
  local function idiv(a, b)
    local q = math.floor(a / b)
    local r = a - q * b
    if r < 0 then q = q - 1 elseif r >= b then q = q + 1 end
    return q, a - q * b
  end

  -- Microseconds (rounded up) for a span given scaled by R.
  local function gcra_us(pair, scaled)
    if scaled <= 0 then return 0 end
    local q, r = idiv(scaled, pair.param)
    if r > 0 then q = q + 1 end
    return q
  end

  local function offset(pair, now, t, f)
    return (tonumber(t) - now) * pair.param + tonumber(f)
  end

  local function time_text(pair, now, x)
    local q, r = idiv(x, pair.param)
    return fmt(now + q) .. ':' .. fmt(r)
  end

  -- "m<w>:<op>": its slot ends at TAT (the common case, written on every immediate
  -- admission); "l<end>:<w>:<op>" once later charges moved TAT past it.
  local function last_item(pair, now, st, item)
    local v, w, op = st.tat, nil, nil
    if string.sub(item, 1, 1) == 'm' then
      w, op = string.match(item, '^m(%d+):(.*)$')
    else
      local t, f
      t, f, w, op = string.match(item, '^l(%-?%d+):(%d+):(%d+):(.*)$')
      v = t and offset(pair, now, t, f) or 0
    end
    if w and v > 0 then st.last = {v = v, w = tonumber(w), op = op} end
  end

  local function parse_last(pair, now, st)
    local text = st.last_text
    if not text then return end
    st.last_text = nil
    last_item(pair, now, st, string.sub(text, 2))
  end

  -- The state as offsets from now scaled by R: tat (>= 0), turns, holes (ascending, disjoint),
  -- last admission; what lies behind now is dropped.
  local function gcra_state(s, pair, now)
    local st = {name = gcra_field(pair), tat = 0, turns = {}, holes = {}}
    local raw = read_field(s, st.name)
    if not raw then return st end
    local a, b, rest = string.match(raw, '^(%-?%d+):(%d+)(.*)$')
    if not a then return st end
    local x = offset(pair, now, a, b)
    if x > 0 then st.tat = x end
    if rest == '' then return st end
    if string.find(rest, ';', 2, true) == nil and string.sub(rest, 2, 2) == 'm' then
      st.last_text = rest  -- only the last admission: parsed if an undo or refund needs it
      return st
    end
    local last_items = {}
    for item in string.gmatch(rest, ';([^;]+)') do
      local kind = string.sub(item, 1, 1)
      if kind == 'r' then
        local t, f, w, op = string.match(item, '^r(%-?%d+):(%d+):(%d+):(.*)$')
        local v = offset(pair, now, t, f)
        if v > 0 then st.turns[#st.turns + 1] = {v = v, w = tonumber(w), op = op} end
      elseif kind == 'h' then
        local t1, f1, t2, f2 = string.match(item, '^h(%-?%d+):(%d+):(%-?%d+):(%d+)$')
        local e = offset(pair, now, t2, f2)
        if e > 0 then st.holes[#st.holes + 1] = {s = offset(pair, now, t1, f1), e = e} end
      elseif kind == 'f' then
        local t, f = string.match(item, '^f(%-?%d+):(%d+)$')
        local v = offset(pair, now, t, f)
        if v > 0 then st.floor = v end
      elseif kind == 'l' or kind == 'm' then
        last_items[#last_items + 1] = item
      elseif kind == 'p' then  -- (an earlier format's note, no longer used)
      else  -- an older version's floor: "<tat>:<frac>:<op>", the latest reservation's TAT
        local t, f, op = string.match(item, '^(%-?%d+):(%d+):(.*)$')
        local v = t and offset(pair, now, t, f) or 0
        if v > 0 then st.turns[#st.turns + 1] = {v = v, w = 0, op = op} end
      end
    end
    for _, item in ipairs(last_items) do last_item(pair, now, st, item) end
    return st
  end

  local function gcra_store(s, pair, now, st)
    while #st.turns > TURNS do
      -- The earliest turn can no longer be undone; its end is kept as a floor, so no refund
      -- or undo frees what it holds.
      local low = 1
      for i, turn in ipairs(st.turns) do
        if turn.v < st.turns[low].v then low = i end
      end
      local turn = table.remove(st.turns, low)
      if not st.floor or turn.v > st.floor then st.floor = turn.v end
    end
    while #st.holes > HOLES do table.remove(st.holes, 1) end  -- its capacity is lost
    if #st.turns == 0 and #st.holes == 0 and not st.floor and not st.last_text then
      local value = time_text(pair, now, st.tat)  -- the common case, without tables
      if st.last and st.last.v == st.tat then
        value = value .. ';m' .. fmt(st.last.w) .. ':' .. st.last.op
      elseif st.last then
        value = value .. ';l' .. time_text(pair, now, st.last.v) .. ':' .. fmt(st.last.w) .. ':'
                .. st.last.op
      end
      stage_set(s, st.name, value)
      want_ttl(s, math.ceil(gcra_us(pair, st.tat) / 1000) + 1)
      return
    end
    local parts = {time_text(pair, now, st.tat)}
    for _, turn in ipairs(st.turns) do
      parts[#parts + 1] = 'r' .. time_text(pair, now, turn.v) .. ':' .. fmt(turn.w) .. ':'
                          .. turn.op
    end
    for _, hole in ipairs(st.holes) do
      parts[#parts + 1] = 'h' .. time_text(pair, now, hole.s) .. ':'
                          .. time_text(pair, now, hole.e)
    end
    if st.floor then parts[#parts + 1] = 'f' .. time_text(pair, now, st.floor) end
    if st.last_text then
      parts[#parts + 1] = string.sub(st.last_text, 2)
    elseif st.last and st.last.v == st.tat then
      parts[#parts + 1] = 'm' .. fmt(st.last.w) .. ':' .. st.last.op
    elseif st.last then
      parts[#parts + 1] = 'l' .. time_text(pair, now, st.last.v) .. ':' .. fmt(st.last.w) .. ':'
                          .. st.last.op
    end
    stage_set(s, st.name, table.concat(parts, ';'))
    want_ttl(s, math.ceil(gcra_us(pair, st.tat) / 1000) + 1)
  end

  -- The earliest hole a request of `need` (scaled) fits in, admitted within `wait` µs (0: at
  -- once): its index, and the slot's start and end.
  local function hole_for(pair, st, need, wait)
    local capacity = pair.amount * pair.period
    for i, hole in ipairs(st.holes) do
      local vs = hole.s
      if vs < 0 then vs = 0 end
      local vend = vs + need
      if vend <= hole.e then
        if vend <= capacity or (wait > 0 and gcra_us(pair, vend - capacity) <= wait) then
          return i, vs, vend
        end
        return nil  -- a later hole would admit later still
      end
    end
    return nil
  end

  -- Once TAT is lowered, holes that reach it are free tail: TAT drops to their start.
  local function absorb(st)
    while true do
      local hole = st.holes[#st.holes]
      if not hole or hole.e < st.tat then break end
      st.tat = hole.s > 0 and hole.s or 0
      table.remove(st.holes)
    end
  end

  -- [lo, hi) is free again: the tail (TAT lowered), else a hole, merged with its neighbours.
  local function free(st, lo, hi)
    if lo < 0 then lo = 0 end
    if lo >= hi then return end
    if hi >= st.tat then
      if lo < st.tat then st.tat = lo end
      absorb(st)
      return
    end
    local i = 1
    while st.holes[i] and st.holes[i].e <= lo do i = i + 1 end  -- (one ending at lo: before)
    table.insert(st.holes, i, {s = lo, e = hi})
    local h = st.holes[i]
    local nxt = st.holes[i + 1]
    if nxt and nxt.s <= h.e then
      if nxt.e > h.e then h.e = nxt.e end
      table.remove(st.holes, i + 1)
    end
    local prev = st.holes[i - 1]
    if prev and prev.e >= h.s then
      if h.e > prev.e then prev.e = h.e end
      table.remove(st.holes, i)
    end
  end

  -- Gives `need` (scaled) back from the tail, past holes, never below the latest turn nor now.
  local function give_back(st, need)
    local floor = st.floor or 0
    for _, turn in ipairs(st.turns) do
      if turn.v > floor then floor = turn.v end
    end
    absorb(st)
    while need > 0 and st.tat > floor do
      local hole = st.holes[#st.holes]
      local low = floor
      if hole and hole.e > low then low = hole.e end
      local x = st.tat - need
      if x < low then x = low end
      need = need - (st.tat - x)
      st.tat = x
      if x ~= low or low == floor then break end
      absorb(st)
    end
    -- The last admission's slot was (partly) given back: its undo may not free it again.
    if st.last and st.last.v > st.tat then st.last = nil end
  end

  local gcra = {
    field = gcra_field,

    check = function(s, pair, now, weight, max_wait)
      local st = gcra_state(s, pair, now)
      local capacity = pair.amount * pair.period  -- B * T, scaled by R
      local held = st.tat
      if weight > 0 and #st.holes > 0 then
        local i, _, vend = hole_for(pair, st, weight * pair.period, max_wait)
        if i then
          local remaining = math.floor((capacity - held) / pair.period)
          if remaining < 0 then remaining = 0 end
          return true, remaining, gcra_us(pair, vend - capacity), gcra_us(pair, held)
        end
      end
      local excess = held + weight * pair.period
      local delay = gcra_us(pair, excess - capacity)
      if excess <= capacity or (max_wait > 0 and delay <= max_wait) then
        local remaining = math.floor((capacity - excess) / pair.period)
        if remaining < 0 then remaining = 0 end
        return true, remaining, delay, gcra_us(pair, excess)
      end
      -- Refused: when it can pass is the first freed turn it fits in (an undone waiter's),
      -- if earlier than past the queue's tail; the room left is never below 0.
      if weight > 0 and #st.holes > 0 then
        local i, _, vend = hole_for(pair, st, weight * pair.period, math.huge)
        if i then
          local at_hole = gcra_us(pair, vend - capacity)
          if at_hole < delay then delay = at_hole end
        end
      end
      local remaining = math.floor((capacity - held) / pair.period)
      if remaining < 0 then remaining = 0 end
      return false, remaining, delay, gcra_us(pair, held)
    end,

    charge = function(s, pair, now, weight, op, reserving)
      local st = gcra_state(s, pair, now)
      local capacity = pair.amount * pair.period
      local need = weight * pair.period
      local i, vs, vend = nil, nil, nil
      if #st.holes > 0 then
        i, vs, vend = hole_for(pair, st, need, reserving and math.huge or 0)
      end
      if i then
        parse_last(pair, now, st)
        local hole = table.remove(st.holes, i)
        -- (what lay before vs is behind now: only the rest of the hole is kept)
        if vend < hole.e then table.insert(st.holes, i, {s = vend, e = hole.e}) end
        st.turns[#st.turns + 1] = {v = vend, w = weight, op = op}
      else
        local x = st.tat + need
        if reserving and x > capacity then
          parse_last(pair, now, st)  -- its end is written out: TAT moves past it
          st.turns[#st.turns + 1] = {v = x, w = weight, op = op}
        else  -- the last admission is this one (its text, if any, is stored as it was else)
          st.last_text = nil
          st.last = op ~= '' and {v = x, w = weight, op = op} or nil
        end
        st.tat = x
      end
      gcra_store(s, pair, now, st)
    end,

    -- Without `at`: gives `weight` back from the tail, never below now nor below the latest
    -- recorded turn (a newcomer queues after it). With `at` (undo of op): see the header.
    refund = function(s, pair, now, weight, at, op)
      local st = gcra_state(s, pair, now)
      parse_last(pair, now, st)
      local need = weight * pair.period
      if at then
        local found = nil
        if op and op ~= '' then
          for k, turn in ipairs(st.turns) do
            if turn.op == op then found = k end
          end
        end
        if found then
          local turn = table.remove(st.turns, found)
          local span = turn.w > 0 and turn.w * pair.period or need
          free(st, turn.v - span, turn.v)
        elseif st.last and op and op ~= '' and st.last.op == op then
          local last = st.last
          st.last = nil
          free(st, last.v - last.w * pair.period, last.v)
        else
          return  -- where its slot lies is not known: nothing is credited (see the header)
        end
      else
        give_back(st, need)
      end
      gcra_store(s, pair, now, st)
    end,
  }

  return gcra
end
