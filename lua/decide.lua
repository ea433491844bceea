-- aiolimit: decide (the entry point; concatenated last, after prelude.lua and the algorithms)
--
-- One call decides for every (identifier, limit) pair it is given, all or nothing.
-- KEYS[k]   storage keys. Each identifier has a main HASH key <prefix>:{<id>}; algorithms
--           with a structure of their own use an aux key with the same hash tag (same slot).
-- ARGV[1]   mode: "acquire" decide; charge every pair only if every pair allows
--                 "check"   decide; write nothing (peek, and phase 1 across cluster slots)
--                 "refund"  give weight back on every pair (newest charges first); with an
--                           op id it is applied once (a retry replays)
--                 "undo"    with an op id: credit exactly what that acquire op charged
--                 "release" with an op id: drop that op's concurrency leases (nothing else)
--                 "renew"   with an op id: extend that op's concurrency leases
-- ARGV[2]   now: integer µs since the epoch, or "" to use this server's TIME
-- ARGV[3]   weight: positive integer
-- ARGV[4]   TTL slack: integer ms added to every TTL (a manual clock's time is not Redis')
-- ARGV[5]   op id, "" for none. With an op id the LAST key is the op's record (a STRING,
--           same slot): acquire writes "A:<µs>,<µs>..." (the time it charged each main key,
--           in order of first appearance) and, when run again with the same id, replays
--           (charges nothing). undo credits exactly what that op charged, once, and leaves
--           "R:..." so a late or retried acquire of the op cannot charge. refund writes "F:".
--           Records expire after OP_RETENTION_MS.
-- ARGV[6]   flags: "p" counts refused requests as a penalty (charges them anyway, except
--                 algorithms marked penalty_free: a refused call takes no concurrency lease);
--           "r<µs>" reserves: pairs that can queue (GCRA) admit a request that fits within
--           that many µs, charging now; its delay is the pair's retry_after while allowed
-- ARGV[7]   B, the number of identifier blocks; ARGV[8 .. 7+B] are the blocks, one string
--           each of comma-separated values:
--             K  its number of keys, taken from KEYS in order (the first is the main key)
--             P  its number of pairs, then per pair 5 values:
--                aux key (0 = none, else 2..K: its position among the block's keys),
--                algorithm code ("sw", ...), amount (integer), period (integer µs),
--                param (integer; meaning per algorithm, see its header)
--           A block names no absolute key index, so the client builds each identifier's
--           block once; one argument per identifier keeps the request small.
-- Reply: {allowed 1|0, replay 1|0, now µs,
--         then per pair i: allowed 1|0, remaining, retry_after µs, reset_after µs}
--         replay is 1 when the op id had already been applied (or refunded: allowed is 0 then).

local mode = ARGV[1]
local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[2])
end
local weight = tonumber(ARGV[3])
local slack = tonumber(ARGV[4])
local op = ARGV[5]
local penalty = string.find(ARGV[6], 'p', 1, true) ~= nil
local max_wait = tonumber(string.match(ARGV[6], 'r(%d+)')) or 0

local pairs_ = {}
local npairs = 0
local key_base = 0
for b = 1, tonumber(ARGV[7]) do
  local v = {}
  for value in string.gmatch(ARGV[7 + b], '[^,]+') do v[#v + 1] = value end
  local at = 3
  for _ = 1, tonumber(v[2]) do
    local aux = tonumber(v[at])
    local pair = {
      main = KEYS[key_base + 1],
      aux = aux > 0 and KEYS[key_base + aux] or nil,
      code = v[at + 1],
      letter = string.sub(v[at + 1], 1, 1),
      algo = algorithm(v[at + 1]),
      amount = tonumber(v[at + 2]),
      period_s = v[at + 3],
      period = tonumber(v[at + 3]),
      param_s = v[at + 4],
      param = tonumber(v[at + 4]),
    }
    if not pair.algo then
      return redis.error_reply('ERR aiolimit: unknown algorithm ' .. tostring(v[at + 1]))
    end
    npairs = npairs + 1
    pairs_[npairs] = pair
    at = at + 5
  end
  key_base = key_base + tonumber(v[1])
end

-- Everything a write could trip on is checked before the first write: Redis keeps the writes
-- of a script that fails half-way, so a late error would break all or nothing.
if not now or not weight or weight < 0 or weight % 1 ~= 0 or not slack then
  return redis.error_reply('ERR aiolimit: bad now, weight or TTL slack')
end
if mode == 'acquire' and op == '' then
  for i = 1, npairs do
    if pairs_[i].code == 'lease' then
      return redis.error_reply('ERR aiolimit: a lease needs an op id')
    end
  end
end

-- Each identifier judges by max(now, its last write): its time never runs backwards.
local mains = {}
local function now_for(s)
  if s.t > now then return s.t end
  return now
end
for i = 1, npairs do
  local s = load_main(pairs_[i].main)
  if not mains[s.key] then
    mains[s.key] = s
    mains[#mains + 1] = s
  end
  pairs_[i].s = s
end

local function flush()
  for _, s in ipairs(mains) do
    if s.dirty then
      local t = now_for(s)
      stage_set(s, 't', fmt(t))
      -- The TTL only ever needs to grow; it is set with TTL_STEP_MS to spare and the expiry
      -- (in this key's time) kept in "x", so a busy key pays PEXPIRE about once a second.
      local expiry = t + (s.ttl_ms + slack) * 1000
      local ttl = nil
      if expiry > (tonumber(s.fields['x']) or 0) then
        ttl = s.ttl_ms + slack + TTL_STEP_MS
        stage_set(s, 'x', fmt(t + ttl * 1000))
      end
      local hset = {}
      for field, value in pairs(s.set) do
        hset[#hset + 1] = field
        hset[#hset + 1] = value
      end
      call_batched('HSET', s.key, nil, hset)
      local hdel = {}
      for field, _ in pairs(s.del) do hdel[#hdel + 1] = field end
      call_batched('HDEL', s.key, nil, hdel)
      if ttl then redis.call('PEXPIRE', s.key, ttl) end
    end
  end
end

local op_key = nil
if op ~= '' then op_key = KEYS[#KEYS] end

local function op_record()
  if not op_key then return nil end
  local rec = redis.call('GET', op_key)
  if not rec then return nil end
  return rec
end

local function op_write(tag, times)
  redis.call('SET', op_key, tag .. ':' .. table.concat(times, ','), 'PX', OP_RETENTION_MS + slack)
end

local function decide_all(w)
  local reply = {0, 0, now}
  local all = true
  for i, pair in ipairs(pairs_) do
    local ok, remaining, retry, reset = pair.algo.check(pair.s, pair, now_for(pair.s), w, max_wait)
    if not ok then all = false end
    local base = 4 + 4 * (i - 1)
    reply[base] = ok and 1 or 0
    reply[base + 1] = remaining
    reply[base + 2] = retry
    reply[base + 3] = reset
  end
  reply[1] = all and 1 or 0
  if not all and w > 0 then
    -- Refused: nothing is charged, so the pairs that would allow report their state as it
    -- is (an allowing check reports the state after its charge).
    for i, pair in ipairs(pairs_) do
      local base = 4 + 4 * (i - 1)
      if reply[base] == 1 then
        local _, remaining, _, reset = pair.algo.check(pair.s, pair, now_for(pair.s), 0, 0)
        reply[base + 1] = remaining
        reply[base + 3] = reset
      end
    end
  end
  return reply, all
end

if mode == 'check' then
  local reply = decide_all(weight)
  return reply
end

if mode == 'acquire' then
  local rec = op_record()
  if rec then
    local reply = decide_all(weight)
    reply[1] = string.sub(rec, 1, 1) == 'A' and 1 or 0
    reply[2] = 1
    return reply
  end
  local reply, all = decide_all(weight)
  if all or penalty then
    for _, pair in ipairs(pairs_) do
      if all or not pair.algo.penalty_free then
        pair.algo.charge(pair.s, pair, now_for(pair.s), weight, op, all and max_wait > 0,
                         not all)
      end
    end
    flush()
    if op_key and all then
      local times = {}
      for i, s in ipairs(mains) do times[i] = fmt(now_for(s)) end
      op_write('A', times)
    end
  end
  -- An algorithm's check, when it allows, already reports the state after the charge.
  return reply
end

if mode == 'refund' or mode == 'undo' then
  local replay = 0
  local at = {}
  local rec = op_record()
  if mode == 'refund' then
    if rec then replay = 1 elseif op_key then op_write('F', {}) end
  elseif not op_key then
    return redis.error_reply('ERR aiolimit: undo needs an op id')
  elseif rec and string.sub(rec, 1, 1) == 'A' then
    local i = 0
    for time in string.gmatch(string.sub(rec, 3), '%d+') do
      i = i + 1
      if mains[i] then at[mains[i].key] = tonumber(time) end
    end
    op_write('R', {string.sub(rec, 3)})
  else
    -- Undone already, or never applied here: credit nothing, and tombstone it so a late
    -- acquire of this op cannot charge.
    replay = 1
    if not rec then op_write('R', {}) end
  end
  if replay == 0 then
    for _, pair in ipairs(pairs_) do
      pair.algo.refund(pair.s, pair, now_for(pair.s), weight, at[pair.s.key], op)
    end
    flush()
  end
  -- The state after the refund, as a request of weight 0 sees it.
  local reply = decide_all(0)
  reply[2] = replay
  return reply
end

if mode == 'release' or mode == 'renew' then
  if op == '' then return redis.error_reply('ERR aiolimit: ' .. mode .. ' needs an op id') end
  for _, pair in ipairs(pairs_) do
    local action = pair.algo[mode]
    if action then action(pair.s, pair, now_for(pair.s), weight, op) end
  end
  flush()
  local reply = decide_all(0)
  return reply
end

return redis.error_reply('ERR aiolimit: unknown mode ' .. tostring(mode))
