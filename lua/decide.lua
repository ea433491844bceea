-- aiolimit: decide (the entry point; concatenated last, after prelude.lua and the algorithms)
--
-- One call decides for every (identifier, limit) pair it is given, all or nothing.
-- KEYS[k]   storage keys. Each identifier has a main HASH key <prefix>:{<id>}; algorithms
--           with a structure of their own use an aux key with the same hash tag (same slot).
-- ARGV[1]   mode: "acquire" decide; charge every pair only if every pair allows
--                 "check"   decide; write nothing (phase 1 across cluster slots): an
--                           allowing pair reports its state after the charge
--                 "peek"    decide; write nothing; every pair reports its state now
--                 "refund"  give weight back on every pair (newest charges first); with an
--                           op id it is applied once (a retry replays)
--                 "undo"    with an op id: credit exactly what that acquire op charged
--                 "release" with an op id: drop that op's concurrency leases (nothing else)
--                 "renew"   with an op id: extend that op's concurrency leases, if they are
--                           all still live (else nothing, and the reply's allowed is 0)
-- ARGV[2]   now: integer µs since the epoch, or "" to use this server's TIME
-- ARGV[3]   weight: positive integer
-- ARGV[4]   TTL slack: integer ms added to every TTL (a manual clock's time is not Redis')
-- ARGV[5]   op, "" for none, else "<client>:<stamp>:<open>": the calling limiter's id (letters
--           and digits), the op's stamp (an integer, increasing per client) and <open>, the
--           comma-separated stamps (ascending, maybe none; the oldest ones, at most 32) of that
--           client's older ops on these identifiers whose outcome it does not know yet: every
--           op older than the oldest of them is settled (the client had its reply, or its
--           undo's). The op's identity, e.g. for
--           leases, is "<client>:<stamp>". Exactly-once bookkeeping lives in each main key,
--           in the field "o:<client>" = "<last write µs>;<horizon>;<entries>", entries being
--           "<stamp>@<µs>" (applied at that time) or "<stamp>@-" (undone, or blocked before it
--           ran), comma-separated, for stamps above the horizon:
--             acquire/refund: an op applied already replays (charges nothing); one undone, or
--                   at or below the horizon, is refused and charges nothing (a late or resent
--                   copy of an op its client gave up on); otherwise it runs and, if it charged,
--                   records "<stamp>@<µs>".
--             undo: credits exactly what that op charged here, once, and leaves "<stamp>@-"
--                   (also when it never ran here, so a late copy cannot charge).
--           Every write sets the horizon to (the oldest open stamp, or this stamp) - 1 and drops
--           the entries at or below it, so the field holds the ops since the client's oldest
--           unsettled one: a few in steady state, whatever the request rate, and while an op
--           is stuck (undo pending) at most OP_KEEP_BYTES (the open ops the call names and the
--           undone ones are kept first). A client field idle for OP_RETENTION_MS is dropped,
--           and beyond OP_CLIENTS fields the least recently written.
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

-- An identifier block (see ARGV[7 + b]) parsed into its pairs' fixed parameters. Blocks repeat
-- from call to call (the client builds each identifier's block once), so as a FUNCTION library
-- the parse is kept, keyed by the block's text (at most BLOCK_CACHE_SIZE of them). A spec's
-- parameters are never written to; an algorithm may memoize there what it derives from them
-- alone (sliding_window.lua its field name).
local BLOCKS, blocks_cached, BLOCK_CACHE_SIZE = {}, 0, 1024
local function parse_block(text)
  local block = BLOCKS[text]
  if block then return block end
  local v = {}
  for value in string.gmatch(text, '[^,]+') do v[#v + 1] = value end
  block = {nkeys = tonumber(v[1]), specs = {}}
  -- A block names at least its main key (K >= 1 when it has pairs), and an aux key is one
  -- of its own (2..K): a malformed block is refused before the call reads any key.
  local k, count = block.nkeys, tonumber(v[2])
  if not k or not count or k % 1 ~= 0 or count % 1 ~= 0 or count < 0 or k < 0
     or (count > 0 and k < 1) then
    return nil, 'ERR aiolimit: bad block ' .. text
  end
  local at = 3
  for i = 1, tonumber(v[2]) do
    local spec = {
      aux = tonumber(v[at]),
      code = v[at + 1],
      letter = string.sub(v[at + 1], 1, 1),
      algo = algorithm(v[at + 1]),
      amount = tonumber(v[at + 2]),
      period_s = v[at + 3],
      period = tonumber(v[at + 3]),
      param_s = v[at + 4],
      param = tonumber(v[at + 4]),
    }
    if not spec.algo then
      return nil, 'ERR aiolimit: unknown algorithm ' .. tostring(v[at + 1])
    end
    local aux = spec.aux
    if not aux or aux % 1 ~= 0 or aux < 0 or aux == 1 or aux > k then
      return nil, 'ERR aiolimit: bad block ' .. text
    end
    block.specs[i] = spec
    at = at + 5
  end
  -- The fast path (see fast_acquire) takes a block of one key whose limits are all sliding
  -- or fixed windows, each under a field of its own: marked on its first spec.
  local fast = k == 1 and count > 0
  local names = {}
  for i = 1, count do
    local spec = block.specs[i]
    local name = spec.code .. spec.period_s .. '/' .. spec.param_s
    if (spec.code ~= 'sw' and spec.code ~= 'fw') or names[name] then fast = false end
    names[name] = true
  end
  if count > 0 then block.specs[1].fast_block = fast end
  if blocks_cached >= BLOCK_CACHE_SIZE then BLOCKS, blocks_cached = {}, 0 end
  BLOCKS[text] = block
  blocks_cached = blocks_cached + 1
  return block
end

-- This call's state. As a FUNCTION library, everything from here to decide() is built once
-- per server and kept between calls (with EVAL, on every call): the functions below are not
-- made again for each call, and they read this call's state from these locals, which decide()
-- sets before anything reads them. Redis runs one script at a time, so calls never share them.
local now = 0  -- this call's time, µs
local slack = 0  -- TTL slack, ms (ARGV[4])
local op = ''  -- this call's op identity "<client>:<stamp>", '' for none
local op_client = nil  -- its client, nil for no op
local op_stamp, op_floor = 0, 0  -- its stamp, and the oldest stamp still open (or the stamp)
local op_field = ''  -- "o:<client>": the client's ledger field
local op_entry = ''  -- "<stamp>@": how the ledger entry of this op begins
local op_open_text = ''  -- the open stamps as sent (ascending): parsed only when needed
local max_wait = 0  -- ARGV[6]'s r<µs>, 0 for none
local op_client_seen, op_field_seen = nil, ''  -- the last client seen and its op_field
-- This call's pairs are PAIRS[1 .. npairs] and its main keys MAINS[1 .. nmains]. The pair
-- tables are reused from call to call (decide() sets every field again), so a call allocates
-- none of them.
local PAIRS, npairs = {}, 0
local MAINS, nmains = {}, 0
local call_seq = 0  -- counts calls (a batch's each): what was looked up per call is redone

local now_text = nil  -- fmt(now), made once per call when first needed

-- A time as stored (see fmt); `now`, the commonest, is formatted once per call.
local function fmt_time(t)
  if t ~= now then return fmt(t) end
  if not now_text then now_text = fmt(now) end
  return now_text
end

-- Each identifier judges by max(now, its last write): its time never runs backwards.
local function now_for(s)
  if s.t > now then return s.t end
  return now
end

-- Exactly-once bookkeeping (see ARGV[5]).

-- This client's ledger in main key s: its horizon, and its entries as text. The entries are
-- never parsed one by one on the common path: a call's cost must not grow with the ops in
-- flight on an identifier (searches and copies of the text run in C). `single` is the stamp
-- of the one entry the entries hold, when that is known without a parse (nil: not known).
-- As a FUNCTION library, a ledger op_record writes is filed under the text it wrote, as
-- sliding_window.lua files its states (see PARSED there): a call that reads that exact text
-- copies it instead of parsing it. `stored` holds the text; op_record clears it first.
-- At most LEDGERS_SIZE ledgers, or LEDGERS_BYTES of text, are filed (a stuck op's ledger
-- grows to OP_KEEP_BYTES, and each is held twice: as the key and as `entries`). A ledger's
-- text is its key's own (stamps), so only the keys written in the last LEDGERS_SIZE ledger
-- writes hit: the busy ones. The bound is small on purpose: what the memos keep alive, Redis'
-- GC step after every 50 script calls walks, and a lone FCALL paid ~25 % more server time
-- with 2048 of each filed (bench.bench --concurrency 1) than with 512 ledgers and 256 states.
local LEDGERS, ledgers_filed, LEDGERS_SIZE = {}, 0, 512
local ledgers_bytes, LEDGERS_BYTES = 0, 262144

-- A stored ledger's horizon, entries and single stamp (nil: not known), from the text.
local function parse_ledger(raw)
  local filed = LEDGERS[raw]
  if filed and filed.stored == raw then return filed.horizon, filed.entries, filed.single end
  local horizon, entries = string.match(raw, '^%d+;(%d+);(.*)$')
  return tonumber(horizon) or 0, entries or '', nil
end

-- Files ledger `l` (horizon, entries, single) under the text `value` just written, when a
-- parse of that text gives it back: fmt wrote now and the horizon as digits (a negative or
-- huge now, sent as such, would not read back).
local function file_ledger(value, l, horizon)
  l.stored = nil
  if now >= 0 and now < 2 ^ 63 and horizon < 2 ^ 63 then
    if ledgers_filed >= LEDGERS_SIZE or ledgers_bytes >= LEDGERS_BYTES then
      LEDGERS, ledgers_filed, ledgers_bytes = {}, 0, 0
    end
    if not LEDGERS[value] then
      ledgers_filed, ledgers_bytes = ledgers_filed + 1, ledgers_bytes + #value
    end
    l.stored = value
    LEDGERS[value] = l
  end
end

-- Where this op's entry is in `entries`: the text after "<stamp>@" ("-" or a time), or nil.
-- A plain search (memchr speed), then a check that it starts an entry.
local function entry_at(entries)
  local from = 1
  while true do
    local first, last = string.find(entries, op_entry, from, true)
    if not first then return nil end
    if first == 1 or string.byte(entries, first - 1) == 44 then  -- 44: ','
      return string.match(entries, '^[%d-]+', last + 1)
    end
    from = last + 1
  end
end

-- `entries` without those at or below `horizon`, cut from the front (they arrive in stamp
-- order, near enough: each is dropped once, so this costs O(1) a call over time).
local function cut_front(entries, horizon)
  local cut = 1
  while true do
    local _, last, stamp = string.find(entries, '^(%d+)@[%d-]+,?', cut)
    if not last or tonumber(stamp) > horizon then break end
    cut = last + 1
  end
  if cut > 1 then return string.sub(entries, cut) end
  return entries
end

-- `entries` (whose one entry, when known, has the stamp `single`; never this op's) with this
-- op's `entry` added, cut at `horizon`. What the cut leaves is known without it when this
-- op's stamp is above the horizon (always but for an undo on a key where the op is settled
-- already) and the entries were empty or held one entry of a known stamp.
local function add_entry(entries, single, horizon, entry)
  if entries == '' then
    if op_stamp > horizon then return entry end
    return cut_front(entry, horizon)
  end
  if single and op_stamp > horizon then
    if single <= horizon then return entry end
    return entries .. ',' .. entry
  end
  return cut_front(entries .. ',' .. entry, horizon)
end

local function ledger(s)
  local ledgers = s.ledgers
  if not ledgers then
    ledgers = {}
    s.ledgers = ledgers
  end
  local l = ledgers[op_field]
  if l then
    if l.seq ~= call_seq then  -- the first use in this call (of a batch): another op now
      l.seq, l.looked = call_seq, false
      if read_field(s, op_field) == nil then s.new_ledger = call_seq end
    end
    return l
  end
  l = {name = op_field, horizon = 0, entries = '', looked = false, at = nil, seq = call_seq,
       single = nil, stored = nil}
  local raw = read_field(s, op_field)
  if raw then
    l.horizon, l.entries, l.single = parse_ledger(raw)
  else
    s.new_ledger = call_seq  -- this call writes a client's first ledger here: prune (flush)
  end
  ledgers[op_field] = l
  return l
end

-- What a ledger recorded for this call's op: its time (applied), false (undone), or nil
-- (nothing). Looked up once per ledger and call, until op_record changes the entries.
local function ledger_at(l)
  if l.looked then return l.at end
  if l.single and l.single ~= op_stamp then  -- (its one entry is another op's)
    l.looked, l.at = true, nil
    return nil
  end
  local at = entry_at(l.entries)
  local result = nil
  if at == '-' then
    result = false
  elseif at ~= nil then
    result = tonumber(at)
  end
  l.looked, l.at = true, result
  return result
end

-- What this op is to main key s: 'new', 'applied' (and when), or 'settled' (undone here,
-- or at or below the horizon: its client knows its outcome, so a copy arriving now is late).
local function op_state(s)
  local l = ledger(s)
  if op_stamp <= l.horizon then return 'settled' end
  local at = ledger_at(l)
  if at == nil then return 'new' end
  if at == false then return 'settled' end
  return 'applied', at
end

-- What this op is to the call's keys together. They are written together, but one key may
-- have expired (its ledger with it) while another lives on: 'applied' anywhere means the op
-- ran, else 'settled' anywhere means it may not run, else it is 'new'.
local function op_state_all()
  local settled = false
  for i = 1, nmains do
    local state = op_state(MAINS[i])
    if state == 'applied' then return 'applied' end
    if state == 'settled' then settled = true end
  end
  if settled then return 'settled' end
  return 'new'
end

-- Records this op in main key s (time µs, or false for undone) and stages the field. The
-- horizon rises to just below the oldest open stamp, and the entries it passed go from the
-- front (they arrive in stamp order, near enough: each entry is dropped once, so this costs
-- O(1) a call over time). Entries of settled ops above the horizon stay until it passes
-- them. Past OP_KEEP_BYTES (a stuck op and much traffic behind it) the oldest entries go,
-- except the open ones the call names and the undone ones: a dropped op's undo would then
-- credit nothing, and a resent copy of it would charge again (both err toward refusing).
-- A key that records an undo lives at least OP_TOMBSTONE_MS, so a late copy finds it.
local function op_record(s, time)
  local l = ledger(s)
  local horizon = l.horizon
  if op_floor - 1 > horizon then horizon = op_floor - 1 end
  local when = '-'
  if time then when = fmt_time(time) end
  local entry = op_entry .. when
  local entries = l.entries
  l.stored = nil  -- (changed from here on: no longer the parse of its filed text)
  if ledger_at(l) ~= nil then  -- (this op's entry is rewritten where it stands)
    local text = string.gsub(',' .. entries .. ',', ',' .. op_entry .. '[%d-]+,',
                             ',' .. entry .. ',', 1)
    entries = cut_front(string.sub(text, 2, -2), horizon)
  else
    entries = add_entry(entries, l.single, horizon, entry)
  end
  if #entries > OP_KEEP_BYTES then
    local open = {}
    for value in string.gmatch(op_open_text, '%d+') do open[tonumber(value)] = true end
    local kept, size = {}, 0
    local all = {}
    for stamp, at in string.gmatch(entries, '(%d+)@([%d-]+)') do
      all[#all + 1] = {tonumber(stamp), stamp .. '@' .. at, at == '-'}
    end
    for i = #all, 1, -1 do  -- newest first: keep what fits, and always the protected
      local e = all[i]
      if e[1] > horizon and (size < OP_KEEP_BYTES / 2 or open[e[1]] or e[3]) then
        kept[#kept + 1] = e
        size = size + #e[2] + 1
      end
    end
    table.sort(kept, function(x, y) return x[1] < y[1] end)
    local text = {}
    for i, e in ipairs(kept) do text[i] = e[2] end
    entries = table.concat(text, ',')
  end
  l.horizon, l.entries, l.looked = horizon, entries, false
  local value = fmt_time(now) .. ';' .. fmt(horizon) .. ';' .. entries
  stage_set(s, l.name, value)
  l.single = nil
  -- (a stamp past 2^63 is written with a "-" by fmt: the front cut cannot read its entry)
  if entries == entry and op_stamp < 2 ^ 63 then l.single = op_stamp end
  file_ledger(value, l, horizon)
  if time == false then want_ttl(s, OP_TOMBSTONE_MS) end
end

-- Drops client fields idle for OP_RETENTION_MS (their clients are gone).
-- Beyond OP_CLIENTS fields, the least recently written go (a fleet of short-lived workers
-- must not pile up ledgers in a busy key); a dropped ledger can only make an undo of its
-- client credit nothing, erring toward refusing.
-- The only read of every field of a key (a call fetches only its own): it runs when a client
-- writes its first ledger in a key, and with the key's TTL, about once every TTL_STEP_MS.
-- Counters no call of this key's current writers names are dropped once empty (see STALE in
-- prelude.lua): a key busy for ever under changing rules keeps a bounded set of fields.
local function op_prune(s)
  local fields = s.fields
  local flat = redis.call('HGETALL', s.key)
  local t = now_for(s)
  for i = 1, #flat, 2 do  -- what the call fetched or staged wins over what is stored
    local name = flat[i]
    if fields[name] == nil then
      local value = flat[i + 1]
      fields[name] = value
      local stale = STALE[string.byte(name, 1)]
      if stale and stale(name, value, t) then stage_del(s, name) end
    end
  end
  local live = {}
  for name, value in pairs(fields) do
    if value and string.sub(name, 1, 2) == 'o:' then
      local last = tonumber(string.match(value, '^(%d+);')) or 0
      if last + OP_RETENTION_MS * 1000 < now then
        stage_del(s, name)
        if s.ledgers then s.ledgers[name] = nil end  -- a later call of a batch reads it anew
      else
        live[#live + 1] = {name = name, last = last}
      end
    end
  end
  if #live > OP_CLIENTS then
    table.sort(live, function(a, b) return a.last < b.last end)
    for i = 1, #live - OP_CLIENTS do
      if not (op_client and live[i].name == op_field) then
        stage_del(s, live[i].name)
        if s.ledgers then s.ledgers[live[i].name] = nil end
      end
    end
  end
end

-- A lease set expires with its main key: its expiry is raised to the main key's after this
-- write (its own TTL is only ever raised). Two keys of one identifier with TTLs of their own
-- would leave one alone for a while, and while its slot is migrating Redis answers a call
-- naming one key present and one absent TRYAGAIN until the slot is assigned (see
-- concurrency.lua's drop). Never lowered: with a client clock behind the server's, the main
-- key's TTL can fall short of a live lease (the TTL slack is for that), and the set must
-- outlive its leases. Where the server has PEXPIRETIME (Redis 7+, Valkey) the absolute
-- expiry is copied: time runs on within a script, and a relative TTL read then set a
-- millisecond later would leave the set a millisecond longer than its main key.
local call_leases = false  -- the call has a concurrency pair
local expiretime = nil  -- the server has PEXPIRETIME (nil: not asked yet)
local function mirror_leases(s, ttl)
  for i = 1, npairs do
    local pair = PAIRS[i]
    if pair.code == 'lease' and pair.main == s.key and pair.aux then
      if expiretime ~= false then
        local at = redis.pcall('PEXPIRETIME', s.key)
        expiretime = type(at) == 'number'
        if expiretime then
          if at > 0 and at > redis.call('PEXPIRETIME', pair.aux) then
            redis.call('PEXPIREAT', pair.aux, at)
          end
        end
      end
      if not expiretime then
        if not ttl then ttl = redis.call('PTTL', s.key) end
        if ttl > 0 and ttl > redis.call('PTTL', pair.aux) then
          redis.call('PEXPIRE', pair.aux, ttl)
        end
      end
    end
  end
end

-- Writes what the call staged: one HSET, one HDEL and (about once a second) one PEXPIRE per
-- main key.
local HSET_ARGS = {}  -- HSET's arguments, reused: only the first n are sent
local function flush()
  CALL.writing = true
  for i = 1, nmains do
    local s = MAINS[i]
    if s.dirty then
      local t = now_for(s)
      stage_set(s, 't', fmt_time(t))
      -- The TTL only ever needs to grow; it is set with TTL_STEP_MS to spare and the expiry
      -- (in this key's time) kept in "x", so a busy key pays PEXPIRE about once a second.
      local expiry = t + (s.ttl_ms + slack) * 1000
      local ttl = nil
      if expiry > (tonumber(read_field(s, 'x')) or 0) then
        ttl = s.ttl_ms + slack + TTL_STEP_MS
        stage_set(s, 'x', fmt(t + ttl * 1000))
      end
      -- Client ledgers are pruned when a new one is written (so OP_CLIENTS holds exactly)
      -- and otherwise with the TTL, about once every TTL_STEP_MS on a busy key: idle ones
      -- are kept for minutes, so that is soon enough, and the scan of every field is not
      -- paid on every call.
      if ttl or s.new_ledger == call_seq then op_prune(s) end
      local hset, n = HSET_ARGS, 0
      for field, value in pairs(s.set) do
        hset[n + 1] = field
        hset[n + 2] = value
        n = n + 2
      end
      if n <= BATCH then
        redis.call('HSET', s.key, unpack(hset, 1, n))
      else
        for i = n + 1, #hset do hset[i] = nil end
        call_batched('HSET', s.key, nil, hset)
      end
      if s.del then
        local hdel = {}
        for field, _ in pairs(s.del) do hdel[#hdel + 1] = field end
        call_batched('HDEL', s.key, nil, hdel)
      end
      if ttl then redis.call('PEXPIRE', s.key, ttl) end
      if call_leases then mirror_leases(s, ttl) end
      -- Written: a later call of the same batch goes on from here, as if it had loaded it.
      s.t, s.existed, s.dirty, s.ttl_ms = t, true, false, 0
      s.set, s.del = nil, nil
    end
  end
end

-- Every pair's check for weight w: the reply, and whether every pair allows.
local function decide_all(w)
  local reply = {0, 0, now}
  local all = true
  local base = 4
  for i = 1, npairs do
    local pair = PAIRS[i]
    local s = pair.s
    local t = s.t
    if t < now then t = now end
    local ok, remaining, retry, reset = pair.algo.check(s, pair, t, w, max_wait)
    if not ok then all = false end
    reply[base] = ok and 1 or 0
    reply[base + 1] = remaining
    reply[base + 2] = retry
    reply[base + 3] = reset
    base = base + 4
  end
  reply[1] = all and 1 or 0
  if not all and w > 0 then
    -- Refused: nothing is charged, so the pairs that would allow report their state as it
    -- is (an allowing check reports the state after its charge).
    for i = 1, npairs do
      local pair = PAIRS[i]
      local base_i = 4 + 4 * (i - 1)
      if reply[base_i] == 1 then
        local _, remaining, _, reset = pair.algo.check(pair.s, pair, now_for(pair.s), 0, 0)
        reply[base_i + 1] = remaining
        reply[base_i + 3] = reset
      end
    end
  end
  return reply, all
end

-- One call. Loaded with EVAL the script ends with `return decide(KEYS, ARGV)`; as a FUNCTION
-- library, the registered function calls it (aiolimit/_calls.py builds both from these files).
-- `batch` is given by decide_many (below) only: the main keys stay loaded from one call of the
-- batch to the next, and the server's TIME is read once per batch. KEYS and ARGV are the
-- call's own (decide_many gives each call a copy of its part: a malformed call can then read
-- nothing of its neighbours').
local FAST_BLOCKS = 8  -- identifiers a call may name and take the fast path
local FAST_ENDS = {}  -- per block of the call: its last pair's index in PAIRS
local FAST_NAMES = {}  -- an HMGET's field names, reused
local FAST_SETS = {}  -- per key: its HSET's arguments, reused
local FAST_REPLY = {}  -- per pair: allowed, remaining, retry, reset, then with weight 0
local FAST_REFUSED = false  -- some pair of the call refuses
local FAST_LEDGERS = {}  -- per key: its ledger's new horizon, entries and single stamp

-- One key's part (block b: pairs first .. last): reads it, and stages its HSET in
-- FAST_SETS[b] and its ledger in FAST_LEDGERS; false when the general way must decide.
local function fast_key(b, key, first, last, weight)
  local names = FAST_NAMES
  names[1], names[2], names[3] = 't', 'x', op_field
  local k = last - first + 1
  for i = 1, k do
    local pair = PAIRS[first + i - 1]
    names[3 + i] = pair.algo.field(pair)
  end
  local v = redis.call('HMGET', key, unpack(names, 1, 3 + k))
  local raw_t, raw_ledger = v[1], v[3]
  if not raw_t or not raw_ledger then return false end  -- a new key, or a first ledger: pruned
  local t = tonumber(raw_t) or 0
  if t < now then t = now end
  -- This client's ledger (see ledger() and op_state()): the op must be new here.
  local horizon, entries, single = parse_ledger(raw_ledger)
  if op_stamp <= horizon then return false end
  if not (single and single ~= op_stamp) and entry_at(entries) then return false end
  -- Every pair: its new text, or nil (the general way then).
  local set = FAST_SETS[b]
  if not set then
    set = {n = 0}
    FAST_SETS[b] = set
  end
  local reply = FAST_REPLY
  local ttl_ms = 0
  local refused = false
  for i = 1, k do
    local at = first + i - 1
    local pair = PAIRS[at]
    local ok, value, remaining, retry, reset, ttl, remaining0, reset0 =
      pair.algo.fast(v[3 + i] or nil, pair, t, weight)
    if ok == nil then return false end
    local r = 6 * at
    reply[r - 5], reply[r - 4], reply[r - 3], reply[r - 2] = ok, remaining, retry, reset
    if ok then
      reply[r - 1], reply[r] = remaining0, reset0
      set[2 * i + 3], set[2 * i + 4] = names[3 + i], value
      if ttl > ttl_ms then ttl_ms = ttl end
    else
      refused = true
    end
  end
  FAST_REFUSED = FAST_REFUSED or refused
  if refused then return true end  -- (nothing is written: the rest does not matter)
  if t + (ttl_ms + slack) * 1000 > (tonumber(v[2]) or 0) then return false end  -- (TTL, prune)
  -- The op's entry (see op_record, for a new op).
  local floor = op_floor - 1
  if floor > horizon then horizon = floor end
  local entry = op_entry .. fmt_time(t)
  entries = add_entry(entries, single, horizon, entry)
  if #entries > OP_KEEP_BYTES then return false end
  set[1], set[2], set[3] = 't', fmt_time(t), op_field
  set[4] = fmt_time(now) .. ';' .. fmt(horizon) .. ';' .. entries
  set.n = 4 + 2 * k
  local one = false
  if entries == entry and op_stamp < 2 ^ 63 then one = op_stamp end
  local staged = FAST_LEDGERS
  staged[3 * b - 2], staged[3 * b - 1], staged[3 * b] = horizon, entries, one
  return true
end

-- The fast path: the commonest call, an acquire with an op id and no flags, on identifiers
-- (at most FAST_BLOCKS, one key each) whose limits are all sliding (or fixed) windows,
-- takes one HMGET and one HSET per key, and no tables but the reply and the memos (the
-- general way builds each key's state, its ledger's and its pairs' as tables). It runs only
-- in the common case: every key and this client's ledger in it exist, the op is new in each,
-- every pair allows and drops no record from its window (see the algorithm's `fast`), no
-- TTL needs extending and no ledger trimming past OP_KEEP_BYTES. Anything else returns nil
-- before the first write, and decide() goes on the general way (which reads the keys
-- again): the writes and the reply are those the general way makes (tests/test_fast_path.py
-- runs both on the same calls and compares them). In a batch, a key an earlier call of the
-- batch loaded is left to the general way, which goes on from that state.
local function fast_acquire(KEYS, nblocks, weight, batch)
  for b = 1, nblocks do
    local key = KEYS[b]
    if batch and loaded[key] then return nil end
    for c = 1, b - 1 do
      if KEYS[c] == key then return nil end
    end
  end
  local first = 1
  FAST_REFUSED = false
  for b = 1, nblocks do
    if not fast_key(b, KEYS[b], first, FAST_ENDS[b], weight) then return nil end
    first = FAST_ENDS[b] + 1
  end
  local reply = FAST_REPLY
  if FAST_REFUSED then
    -- Refused: nothing is written; a pair that allows reports its state as it is.
    local out = {0, 0, now}
    for i = 1, npairs do
      local at, r = 4 * i, 6 * i
      if reply[r - 5] then
        out[at], out[at + 1], out[at + 2], out[at + 3] = 1, reply[r - 1], 0, reply[r]
      else
        out[at], out[at + 1], out[at + 2], out[at + 3] = 0, reply[r - 4], reply[r - 3],
                                                         reply[r - 2]
      end
    end
    return out
  end
  -- Written: one HSET per key.
  CALL.writing = true
  local staged = FAST_LEDGERS
  for b = 1, nblocks do
    local set = FAST_SETS[b]
    redis.call('HSET', KEYS[b], unpack(set, 1, set.n))
    local horizon = staged[3 * b - 2]
    file_ledger(set[4], {horizon = horizon, entries = staged[3 * b - 1],
                         single = staged[3 * b] or nil, stored = nil}, horizon)
  end
  local out = {1, 0, now}
  for i = 1, npairs do
    local at, r = 4 * i, 6 * i
    out[at], out[at + 1], out[at + 2], out[at + 3] = 1, reply[r - 4], 0, reply[r - 2]
  end
  return out
end

local FIELDS = {}  -- field names a key's fetch asks for, reused
local function decide(KEYS, ARGV, batch)
  call_seq = call_seq + 1
  CALL.emptied = nil
  if not batch then loaded = {} end
  now_text = nil
  slack = small_int(ARGV[4])
  CALL.slack = slack or 0
  local mode = ARGV[1]
  if ARGV[2] == '' then
    if batch and batch.now then
      now = batch.now
    else
      local t = redis.call('TIME')
      now = tonumber(t[1]) * 1000000 + tonumber(t[2])
      if batch then batch.now = now end
    end
  else
    now = tonumber(ARGV[2])
  end
  local weight = small_int(ARGV[3])
  op = ARGV[5]
  local flags = ARGV[6]
  local penalty = false
  max_wait = 0
  if flags ~= '' then
    penalty = string.find(flags, 'p', 1, true) ~= nil
    max_wait = tonumber(string.match(flags, 'r(%d+)')) or 0
  end

  local previous = npairs
  npairs = 0
  local key_base = 0
  local nblocks = small_int(ARGV[7])
  if not nblocks or nblocks < 0 or nblocks % 1 ~= 0 or 7 + nblocks > #ARGV then
    return redis.error_reply('ERR aiolimit: bad block count ' .. tostring(ARGV[7]))
  end
  local nk = #KEYS
  local fast = nblocks > 0 and nblocks <= FAST_BLOCKS
  call_leases = false
  for b = 1, nblocks do
    local block, err = parse_block(ARGV[7 + b])
    if not block then return redis.error_reply(err) end
    if key_base + block.nkeys > nk then
      return redis.error_reply('ERR aiolimit: the blocks name more keys than the call has')
    end
    local specs = block.specs
    if fast and not (specs[1] and specs[1].fast_block) then fast = false end
    for j = 1, #specs do
      local spec = specs[j]
      npairs = npairs + 1
      local pair = PAIRS[npairs]
      if not pair then
        pair = {}
        PAIRS[npairs] = pair
      end
      pair.spec = spec
      pair.main = KEYS[key_base + 1]
      pair.aux = spec.aux > 0 and KEYS[key_base + spec.aux] or nil
      pair.code, pair.letter, pair.algo = spec.code, spec.letter, spec.algo
      pair.amount, pair.period, pair.param = spec.amount, spec.period, spec.param
      pair.period_s, pair.param_s = spec.period_s, spec.param_s
      pair.s = nil
      if spec.code == 'lease' then call_leases = true end
    end
    key_base = key_base + block.nkeys
    FAST_ENDS[b] = npairs
  end
  for i = npairs + 1, previous do PAIRS[i].s = nil end  -- let go of an earlier call's keys

  -- Everything a write could trip on is checked before the first write: Redis keeps the writes
  -- of a script that fails half-way, so a late error would break all or nothing.
  if not now or not weight or weight < 0 or weight % 1 ~= 0 or not slack then
    return redis.error_reply('ERR aiolimit: bad now, weight or TTL slack')
  end
  if mode == 'acquire' and op == '' then
    for i = 1, npairs do
      if PAIRS[i].code == 'lease' then
        return redis.error_reply('ERR aiolimit: a lease needs an op id')
      end
    end
  end

  op_client, op_stamp, op_floor, op_open_text = nil, 0, 0, ''
  if op ~= '' then
    local id, client, stamp, open = string.match(op, '^((%w+):(%d+)):([%d,]*)$')
    if not client then return redis.error_reply('ERR aiolimit: bad op ' .. op) end
    op_client, op_stamp = client, tonumber(stamp)
    op_floor = op_stamp
    op_open_text = open
    if open ~= '' then
      -- The open stamps are ascending (aiolimit/_ops.py sorts them): the first is the oldest.
      local oldest = tonumber(string.match(open, '%d+'))
      if oldest and oldest < op_floor then op_floor = oldest end
    end
    if client ~= op_client_seen then op_client_seen, op_field_seen = client, 'o:' .. client end
    op_field = op_field_seen
    if #stamp <= 15 and string.byte(stamp, 1) ~= 48 then  -- 48: '0'
      op_entry = stamp .. '@'  -- (the text fmt(op_stamp) makes, without string.format)
    else
      op_entry = fmt(op_stamp) .. '@'
    end
    op = id
  end

  if fast and mode == 'acquire' and op_client and flags == '' and weight > 0
     and npairs <= 64 then
    local reply = fast_acquire(KEYS, nblocks, weight, batch)
    if reply then return reply end
  end

  -- The main keys, each fetched once (see load_main): the fields this call's pairs read, and
  -- its client's ledger. An identifier's pairs come one after the other (one block), so the
  -- names of a key gather in FIELDS until the key changes.
  previous = nmains
  nmains = 0
  local nfields, current = 0, nil
  for i = 1, npairs do
    local pair = PAIRS[i]
    local s = load_main(pair.main)
    if s ~= current then
      if current then fetch(current, FIELDS, 1, nfields) end
      current, nfields = s, 0
      if op_client then
        nfields = 1
        FIELDS[1] = op_field
      end
    end
    if s.listed ~= call_seq then
      s.listed = call_seq
      -- (the TTL a key wants is this call's: one that asked without writing the key, a
      -- renew, left its want on the key, and flush resets only the keys it wrote)
      s.ttl_ms = 0
      nmains = nmains + 1
      MAINS[nmains] = s
    end
    pair.s = s
    local name = pair.algo.field and pair.algo.field(pair)
    if name then
      nfields = nfields + 1
      FIELDS[nfields] = name
    end
  end
  if current then fetch(current, FIELDS, 1, nfields) end
  for i = nmains + 1, previous do MAINS[i] = nil end

  if mode == 'check' or mode == 'peek' then
    local reply, all = decide_all(weight)
    if mode == 'peek' and all and weight > 0 then
      -- Nothing is charged: report what is left now, as a refusal already does.
      for i = 1, npairs do
        local pair = PAIRS[i]
        local base = 4 + 4 * (i - 1)
        local _, remaining, _, reset = pair.algo.check(pair.s, pair, now_for(pair.s), 0, 0)
        reply[base + 1] = remaining
        reply[base + 3] = reset
      end
    end
    return reply
  end

  if mode == 'acquire' then
    if op_client then
      local state = op_state_all()
      if state ~= 'new' then
        local reply = decide_all(weight)
        reply[1] = state == 'applied' and 1 or 0
        reply[2] = 1
        return reply
      end
    end
    local reply, all = decide_all(weight)
    if all or penalty then
      CALL.writing = true
      local reserved = all and max_wait > 0
      for i = 1, npairs do
        local pair = PAIRS[i]
        local algo = pair.algo
        if all or not algo.penalty_free then
          algo.charge(pair.s, pair, now_for(pair.s), weight, op, reserved, not all)
        end
      end
      if op_client then
        for i = 1, nmains do
          local s = MAINS[i]
          op_record(s, now_for(s))
        end
      end
      flush()
    end
    -- An algorithm's check, when it allows, already reports the state after the charge.
    return reply
  end

  if mode == 'refund' or mode == 'undo' or mode == 'release' then
    -- These write pair by pair and read a pair's sorted set only when they get to it (an
    -- acquire reads every one before it writes). With several sets, each is read once first,
    -- so one that cannot be read (a wrong type) fails the call before its first write.
    local first_aux = nil
    for i = 1, npairs do
      local aux = PAIRS[i].aux
      if aux and aux ~= first_aux then
        if first_aux then
          for j = 1, npairs do
            if PAIRS[j].aux then redis.call('ZCOUNT', PAIRS[j].aux, '+inf', '+inf') end
          end
          break
        end
        first_aux = aux
      end
    end
  end

  if mode == 'refund' or mode == 'undo' then
    if mode == 'undo' and not op_client then
      return redis.error_reply('ERR aiolimit: undo needs an op id')
    end
    local replay = 0
    local at = {}
    if op_client then
      local state = op_state_all()
      if mode == 'refund' and state ~= 'new' then
        replay = 1
      elseif mode == 'undo' then
        if state == 'applied' then
          -- Credit each key at the time the op charged it; a key that lost its entry (it
          -- expired since) lost that charge with it: nothing to credit there.
          for i = 1, nmains do
            local s = MAINS[i]
            local kind, charged = op_state(s)
            if kind == 'applied' then at[s.key] = charged end
          end
        else
          replay = 1
        end
        -- Undone here: a late or resent copy of the op cannot charge any more.
        if state ~= 'settled' then
          for i = 1, nmains do op_record(MAINS[i], false) end
        end
      end
    end
    if replay == 0 then
      CALL.writing = true
      for i = 1, npairs do
        local pair = PAIRS[i]
        if mode == 'refund' or at[pair.s.key] then
          pair.algo.refund(pair.s, pair, now_for(pair.s), weight, at[pair.s.key], op)
        end
      end
      if mode == 'refund' and op_client then  -- (a key that did not exist has nothing to refund)
        for i = 1, nmains do
          local s = MAINS[i]
          if s.existed then op_record(s, now_for(s)) end
        end
      end
    end
    flush()
    -- The state after the refund, as a request of weight 0 sees it.
    local reply = decide_all(0)
    reply[2] = replay
    return reply
  end

  if mode == 'release' or mode == 'renew' then
    if op == '' then return redis.error_reply('ERR aiolimit: ' .. mode .. ' needs an op id') end
    -- renew must find every lease of the op still live: one that expired may be another
    -- holder's slot by now, so it is not brought back (the reply's allowed is 0 then).
    local held = true
    if mode == 'renew' then
      for i = 1, npairs do
        local pair = PAIRS[i]
        if pair.algo.held and not pair.algo.held(pair, now_for(pair.s), op) then held = false end
      end
    end
    if held then
      CALL.writing = true
      for i = 1, npairs do
        local pair = PAIRS[i]
        local action = pair.algo[mode]
        if action then action(pair.s, pair, now_for(pair.s), weight, op) end
      end
      flush()
    end
    local reply = decide_all(0)
    if not held then reply[1] = 0 end
    return reply
  end

  return redis.error_reply('ERR aiolimit: unknown mode ' .. tostring(mode))
end

-- Several calls in one: what a pipeline of single calls would do, in one script run.
-- ARGV[1]   n, the number of calls; then per call: its number of keys, its number of
--           arguments, and those arguments (as a single call's ARGV). KEYS: every call's keys,
--           in call order.
-- Reply: n replies, each a single call's reply or its error.
-- Each call is decided and written in turn, exactly as alone, but a main key is read once
-- per batch (later calls go on from the state the earlier ones wrote) and TIME once: a
-- script run, its TIME and its HGETALLs are most of a small call's server time. A call that
-- fails part way (an error raised, not returned) is that call's error reply; what the batch
-- holds loaded is then dropped and read again, so no later call sees a write it did not make.
-- A batch's layout (4 values per call) and a call's KEYS and ARGV are tables kept from batch
-- to batch and filled anew (what is past a call's own is cleared), so a call allocates none.
local STARTS, CALL_KEYS, CALL_ARGS = {}, {}, {}
local function run_many(KEYS, ARGV, first, verify)
  local n = tonumber(ARGV[first])
  if not n or n < 0 or n % 1 ~= 0 then
    return redis.error_reply('ERR aiolimit: bad call count ' .. tostring(ARGV[first]))
  end
  -- The whole layout is checked before the first call runs: a bad one runs nothing.
  local starts = STARTS
  local k, a = 0, first + 1
  for c = 1, n do
    local nkeys, nargs = small_int(ARGV[a]), small_int(ARGV[a + 1])
    if not nkeys or not nargs or nkeys < 0 or nargs < 0 or nkeys % 1 ~= 0 or nargs % 1 ~= 0
       or k + nkeys > #KEYS or a + 1 + nargs > #ARGV then
      return redis.error_reply('ERR aiolimit: bad batch layout at call ' .. c)
    end
    local at4 = 4 * c
    starts[at4 - 3], starts[at4 - 2], starts[at4 - 1], starts[at4] = k, a, nkeys, nargs
    k, a = k + nkeys, a + 2 + nargs
  end
  local batch = {now = nil}
  local replies = {}
  local gone = nil  -- keys an earlier call of the batch emptied (nil: none)
  loaded = {}
  for c = 1, n do
    local at4 = 4 * c
    local k0, a0, nk, na = starts[at4 - 3], starts[at4 - 2], starts[at4 - 1], starts[at4]
    local keys, args = CALL_KEYS, CALL_ARGS
    for i = 1, nk do keys[i] = KEYS[k0 + i] end
    for i = nk + 1, #keys do keys[i] = nil end
    for i = 1, na do args[i] = ARGV[a0 + 1 + i] end
    for i = na + 1, #args do args[i] = nil end
    local ok, reply
    CALL.writing = false  -- (set by decide just before its first write)
    CALL.emptied = nil
    local hit = nil  -- this call's keys that an earlier call of the batch emptied
    if gone then
      for i = 1, #keys do
        if gone[keys[i]] then
          hit = hit or {}
          hit[#hit + 1] = keys[i]
        end
      end
    end
    local unserved = false
    if hit and not (verify and nk > 1) then
      -- Its keys were there when the batch began (declared keys are checked then), but on a
      -- slot being migrated an emptied one is "non local" now, and this call could meet it
      -- after a write of its own: it is read first, so the call fails before it runs.
      ok, reply = pcall(redis.call, 'EXISTS', unpack(hit))
      if ok then ok, reply = pcall(decide, keys, args, batch) else unserved = true end
    elseif verify and nk > 1 then
      -- Keys not declared are checked where they are read. A call's first read comes before
      -- its first write, but with several keys a later one may fail after a write (a slot
      -- half migrated): all of them are checked first, as a declared key would have been.
      ok, reply = pcall(redis.call, 'EXISTS', unpack(keys))
      if ok then ok, reply = pcall(decide, keys, args, batch) end
    else
      ok, reply = pcall(decide, keys, args, batch)
    end
    if CALL.emptied then
      gone = gone or {}
      for key in pairs(CALL.emptied) do gone[key] = true end
    end
    if ok then
      replies[c] = reply
    else
      if unserved or (verify and not CALL.writing) then
        -- Failed before its first write (a key of a slot this node does not serve now, or
        -- half migrated; or any other error): nothing of it ran, so its client may send it
        -- again through the cluster's redirections. One that failed after writing is not
        -- tagged: sending it again could apply part of it twice.
        local text = type(reply) == 'table' and reply.err or tostring(reply)
        replies[c] = redis.error_reply('ERR aiolimit: unserved: ' .. text)
      elseif type(reply) == 'table' and reply.err then
        replies[c] = reply
      else
        replies[c] = redis.error_reply('ERR aiolimit: ' .. tostring(reply))
      end
      loaded = {}
    end
  end
  return replies
end

local function decide_many(KEYS, ARGV)
  return run_many(KEYS, ARGV, 1, false)
end

-- Several calls in one, on keys of several slots of one Redis Cluster node (registered with
-- the flag allow-cross-slot-keys; the calls' keys are not declared, as a declared key's slot
-- routes a call and all of them must share it).
-- ARGV[1]   K, the number of keys; ARGV[2 .. K+1] every call's keys, in call order; then
--           decide_many's ARGV from ARGV[K+2]: the number of calls, and per call its key
--           count, its argument count and its arguments.
-- Reply: as decide_many's. Each call's keys share one slot (the client groups them so). A call
-- whose keys this node cannot serve now (a stale slot map, a slot migrating, the cluster down)
-- fails when it touches them: at its one key's first read, or, with several keys, at an
-- EXISTS of all of them first (as declared keys would at the command's entry). A call that
-- failed before its first write, for whatever reason, answers "ERR aiolimit: unserved: <the
-- error>": its client sends it again through the cluster's redirections (the servers word
-- the error itself differently). The other calls run.
local function decide_node(KEYS, ARGV)
  if #KEYS ~= 0 then
    return redis.error_reply('ERR aiolimit: decide_node takes its keys in ARGV')
  end
  local nkeys = tonumber(ARGV[1])
  if not nkeys or nkeys < 0 or nkeys % 1 ~= 0 or nkeys + 2 > #ARGV then
    return redis.error_reply('ERR aiolimit: bad key count ' .. tostring(ARGV[1]))
  end
  local keys = {}
  for i = 1, nkeys do keys[i] = ARGV[1 + i] end
  return run_many(keys, ARGV, nkeys + 2, true)
end
