-- aiolimit: prelude (shared by every algorithm; concatenated first by the script loader)
--
-- Not a script on its own. The loader (aiolimit/_scripts.py) builds ONE script from
--   prelude.lua, then every algorithm file (each adds a factory to FACTORIES), then decide.lua
-- so that a decision over any mix of algorithms is one atomic call.
--
-- Per-identifier state lives in one HASH, the identifier's "main key" (<prefix>:{<id>}):
--   t              last time (µs) this identifier was written; time never runs backwards
--   x              when (µs, in the same time) the key's TTL runs out at the earliest
--   <algorithm fields>, named by each algorithm (see their headers)
-- Times are integers in microseconds; they are never formatted with tostring (Lua 5.1 would
-- print 1.7e+15), always with string.format('%d').

-- Loaded as a FUNCTION library (Redis 7+, Valkey) everything up to decide() is built once per
-- server and kept between calls; run with EVAL it is built on every call. So state that
-- belongs to one call lives only in CALL, `loaded` and decide.lua's call state, which decide()
-- resets first.
-- slack: this call's TTL slack, ms (ARGV[4]); writing: the call has reached its first write;
-- emptied: the aux keys this call emptied (nil: none), see mark_emptied() below
local CALL = {slack = 0, writing = false, emptied = nil}
local ALGORITHMS = {}  -- code -> {check, charge, refund[, release, renew, field]}
local FACTORIES = {}  -- code -> function building that table
-- A counter field of a limit no call names any more (a rules version replaced it, or another
-- limiter's rules use it) is read by nobody, so nothing else would ever drop it while the key
-- stays busy. STALE[first byte of its name](name, value, now) is true when the field holds
-- nothing at `now` (the key's time): dropping it then changes no decision, as a field that
-- never existed reads the same. decide.lua's op_prune asks, about once every TTL_STEP_MS.
local STALE = {}

-- Each algorithm file registers a factory; a call builds only the algorithms it uses, so
-- the script's fixed cost does not grow with every algorithm it knows.
local function algorithm(code)
  local algo = ALGORITHMS[code]
  if not algo and FACTORIES[code] then
    algo = FACTORIES[code]()
    ALGORITHMS[code] = algo
  end
  return algo
end
-- A client's op ledger in a key is dropped after this long without a write from it: longer
-- than the limiter retries an undo (5 minutes) plus a deadline of several minutes.
local OP_RETENTION_MS = 900000
-- A key that records an undo lives at least this long, so a copy of the op that arrives late
-- (from a socket of a stopped server, say) still finds the tombstone.
local OP_TOMBSTONE_MS = 5000
local OP_CLIENTS = 64  -- client ledgers one key keeps at most (the most recently written)
local OP_KEEP_BYTES = 65536  -- a client's ledger text in one key at most (a safety valve)
local TTL_STEP_MS = 1000  -- TTLs are set this much longer than needed, and so set less often

-- The small integers every call sends (its weight, TTL slack, block and batch counts) repeat
-- from call to call: as a FUNCTION library each text is parsed once per server (tonumber runs
-- strtod, ~0.1 µs). At most SMALL_SIZE texts of at most 8 bytes are kept; others are parsed.
local SMALL, small_count, SMALL_SIZE = {}, 0, 4096
local function small_int(text)
  local value = SMALL[text]
  if value ~= nil then return value or nil end
  value = tonumber(text)
  if small_count < SMALL_SIZE and type(text) == 'string' and #text <= 8 then
    SMALL[text] = value or false
    small_count = small_count + 1
  end
  return value
end

local function fmt(n)
  return string.format('%d', n)
end

-- Lua 5.1's unpack fails past ~8,000 values ("too many results to unpack"), so long argument
-- lists go out in slices of BATCH values (even, so ZADD's score/member pairs stay whole).
-- `option` (or nil) is repeated before each slice, e.g. ZADD's "XX".
local BATCH = 1000
local function call_batched(command, key, option, values)
  for i = 1, #values, BATCH do
    local last = math.min(i + BATCH - 1, #values)
    if option then
      redis.call(command, key, option, unpack(values, i, last))
    else
      redis.call(command, key, unpack(values, i, last))
    end
  end
end

-- A main key's state, once per script call (a batch's: once per batch). Only the fields a
-- call reads are fetched, with one HMGET (see fetch()): "t", "x", the call's client ledger and
-- its pairs' own fields. A key also holds other limits' fields and up to OP_CLIENTS ledgers
-- (one per client process writing it, a whole fleet's on a busy identifier), and a call's
-- cost must not grow with them. In `fields` a fetched field is its value, or false when the
-- key does not have it; nil is a field not fetched (read it with read_field()). Algorithms stage
-- writes in `set` and `del`; decide.lua flushes them with one HSET, one HDEL and one PEXPIRE
-- per key.
local loaded = {}  -- reset by decide() at the start of every call
local function load_main(key)
  local s = loaded[key]
  if s then return s end
  -- set and del (the staged writes) are made on the first write: a check writes nothing.
  -- t and existed are set by the first fetch. Every field the scripts give s is named here,
  -- nil or not, so the table is made at its full size (growing it rehashes, ~0.1 µs a step).
  s = {key = key, fields = {}, fetched = false, t = 0, existed = false,
       set = nil, del = nil, ttl_ms = 0, dirty = false,
       listed = nil, ledgers = nil, new_ledger = nil, sw = nil}
  loaded[key] = s
  return s
end

-- Fetches names[first .. last] that s has not fetched (with "t" and "x" on its first fetch):
-- one HMGET (slices of BATCH names past that). A name may repeat.
local FETCH = {}  -- the HMGET's field names, reused: only the first m are sent
local function fetch(s, names, first, last)
  local fields = s.fields
  local m = 0
  local first_fetch = not s.fetched
  if first_fetch then
    FETCH[1], FETCH[2] = 't', 'x'
    m = 2
  end
  for i = first, last do
    local name = names[i]
    if fields[name] == nil then
      fields[name] = false  -- (taken: a repeated name is asked for once)
      m = m + 1
      FETCH[m] = name
    end
  end
  for i = 1, m, BATCH do
    local upto = math.min(i + BATCH - 1, m)
    local values = redis.call('HMGET', s.key, unpack(FETCH, i, upto))
    for j = i, upto do fields[FETCH[j]] = values[j - i + 1] end
  end
  if first_fetch then
    s.fetched = true
    s.t = tonumber(fields['t']) or 0
    -- Every write of a main key sets "t" (flush), so without it the key is new, or was
    -- edited by hand: then any field tells (a refund must record its op where it credits).
    local existed = fields['t'] ~= false
    if not existed then
      for j = 1, m do
        if fields[FETCH[j]] then existed = true end
      end
      existed = existed or redis.call('EXISTS', s.key) == 1
    end
    s.existed = existed
  end
end

-- A field's value, nil if the key does not have it. One that no fetch named is read now (an
-- algorithm names its own field ahead, see `field` in decide.lua; this is the safety net).
local ONE_NAME = {}
local function read_field(s, name)
  local value = s.fields[name]
  if value == nil then
    ONE_NAME[1] = name
    fetch(s, ONE_NAME, 1, 1)
    value = s.fields[name]
  end
  if value == false then return nil end
  return value
end

local function stage_set(s, field, value)
  s.fields[field] = value
  local set = s.set
  if not set then
    set = {}
    s.set = set
  end
  set[field] = value
  if s.del then s.del[field] = nil end
  s.dirty = true
end

-- (A field never fetched is deleted too: HDEL of a field the key does not have is harmless.)
local function stage_del(s, field)
  if s.fields[field] ~= false then
    s.fields[field] = false
    if s.set then s.set[field] = nil end
    local del = s.del
    if not del then
      del = {}
      s.del = del
    end
    del[field] = true
    s.dirty = true
  end
end

-- A sorted set this call emptied (Redis deleted it) is never touched again in the call: on a
-- Redis Cluster slot being migrated, a key its node does not hold answers "non local key",
-- and a script that fails then keeps the writes it made. So an algorithm adds before it
-- removes, keeps one entry of a set it goes on writing, and marks a set it may have emptied:
-- is_emptied() reads it as empty without asking Redis.
local function mark_emptied(key)
  local emptied = CALL.emptied
  if not emptied then
    emptied = {}
    CALL.emptied = emptied
  end
  emptied[key] = true
end

local function is_emptied(key)
  local emptied = CALL.emptied
  return emptied ~= nil and emptied[key] == true
end

local function want_ttl(s, ms)
  if ms > s.ttl_ms then s.ttl_ms = ms end
end
