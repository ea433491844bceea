-- aiolimit: publish a rules document (not an algorithm: the operations side, see
-- aiolimit/_follow.py). Run with EVAL; every key shares one hash tag, so one slot.
--
-- KEYS[1]  the rules document (a JSON string)
-- KEYS[2]  the overrides HASH (identifier -> override as JSON)
-- KEYS[3]  this push's staging HASH, filled before the call ("" overrides: absent)
-- ARGV[1]  the new document
-- ARGV[2]  "1" when the staging hash holds the new overrides, "0" when there are none
-- ARGV[3]  the channel every limiter process listens on
-- ARGV[4]  the message: the new document's version
-- ARGV[5]  the version the pusher saw before (its diff's base; "" for no document), or
--          "sha1:<hex>" for a document it could not read (the SHA-1 of its bytes: replacing
--          an invalid document is compared and set too), or "*" to replace whatever is there
-- Reply: 1 when published; 0 when the document changed since the pusher read it (nothing
-- is written then, and the staging hash is dropped).
--
-- The document, the overrides and the notification change together, atomically: a reader
-- never sees a new document with old overrides.
local current = redis.call('GET', KEYS[1])
if ARGV[5] ~= '*' then
  local seen = ''
  if current and string.sub(ARGV[5], 1, 5) == 'sha1:' then
    seen = 'sha1:' .. redis.sha1hex(current)
  elseif current then
    local ok, doc = pcall(cjson.decode, current)
    if ok and type(doc) == 'table' and type(doc.version) == 'string' then seen = doc.version end
  end
  if seen ~= ARGV[5] then
    redis.call('DEL', KEYS[3])
    return 0
  end
end
if ARGV[2] == '1' then
  redis.call('RENAME', KEYS[3], KEYS[2])
else
  redis.call('DEL', KEYS[2], KEYS[3])
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
