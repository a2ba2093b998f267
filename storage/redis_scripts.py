"""The Lua scripts of the Redis store (``storage.redis_store``): each is one atomic
step of a thread (an append, a claim, a prune), run with EVALSHA."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("ratchet.storage.redis")

REPORT_EVERY_S = 60.0
"""How often the log names one shared index an append or claim left unwritten: every
append of every Run meets it until it is repaired."""


class Skipped:
    """The shared indexes of another type (edited by hand) that a store's appends and
    claims left unwritten (``typed``): logged, each at most every ``REPORT_EVERY_S``.
    ``ratchet verify`` names them on every thread (``storage.redis_audit``)."""

    def __init__(self) -> None:
        self._logged: dict[str, float] = {}

    def of_append(self, thread: str, reply: Any) -> bool:
        """Whether the append script's reply is ``ok`` with the keys it left unwritten
        (reported)."""
        if not (isinstance(reply, list) and reply[0] == "ok"):
            return False
        self.report(thread, reply[1:])
        return True

    def of_claim(self, thread: str, reply: list[Any]) -> list[Any]:
        """The claim script's reply past the keys it left unwritten (reported): what
        appends that moved the thread since the claimer's load left (empty: none)."""
        skipped = int(reply[1])
        self.report(thread, reply[2 : 2 + skipped])
        return reply[2 + skipped :]

    def report(self, thread: str, keys: Sequence[object]) -> None:
        now = time.monotonic()
        for key in dict.fromkeys(str(k) for k in keys):  # owner:OLD may be owner:NEW
            if now - self._logged.get(key, -math.inf) >= REPORT_EVERY_S:
                self._logged[key] = now
                log.error(
                    "the index %s holds a value of another type (edited by hand): thread %s "
                    "and every other goes on without it; delete it, then ratchet verify "
                    "names the Runs it no longer lists",
                    key,
                    thread,
                )


_WHOLE = "local function whole(n) return n and n >= 0 and n < 9007199254740992 and n % 1 == 0 end"
"""A counter the script can add 1 to exactly (Lua counts in doubles): Python reads the
same ones (``storage.redis_rows.number_of``); another is a corrupt meta."""

TYPED = """local function typed(n, from)
  local broken = {keys = {}}
  for i = 1, n do
    local t = redis.call('TYPE', KEYS[i])['ok']
    if t ~= 'none' and t ~= want[i] then
      if i < from then return false, KEYS[i] end
      broken[i] = true
      table.insert(broken.keys, KEYS[i])
    end
  end
  return true, broken
end"""
"""The type check of KEYS[1..n] against ``want``, before any write: a thread's own key
(before ``from``) of another type is that thread's corruption (false and the key); a
shared index (``from`` on) of another type is left out of the writes (``broken[i]``),
its key named in ``broken.keys``."""

# The shebang opts into Redis 7 script flags: without allow-oom the server refuses the
# whole script up front when out of memory, instead of failing between two writes.
# KEYS: meta log sums ops runs:running runs:awaiting runs:ended owner:OLD owner:NEW
# instance. ARGV[16]: the instance token read at connect ('' checks nothing): 'lost'
# when the store's contents are gone (``storage.redis_instance``).
# A thread's own key of another type fails the append closed ('corrupt KEY'); a shared
# index of another type (edited by hand) is no thread's fault, and failing there stalled
# every Run: it is left unwritten and named in the reply, {'ok', KEY...} (``skipped``).
APPEND_LUA = """#!lua
local meta, log, sums, ops = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if ARGV[16] ~= '' and redis.call('GET', KEYS[10]) ~= ARGV[16] then return 'lost' end
local want = {'hash', 'list', 'list', 'hash', 'hash', 'hash', 'hash', 'hash', 'hash'}
%(typed)s
local ok, broken = typed(9, 5)
if not ok then return 'corrupt ' .. broken end
local f = redis.call('HMGET', meta, 'epoch', 'version', 'pruned')
local epoch, version, pruned = tonumber(f[1] or '0'), tonumber(f[2] or '0'), tonumber(f[3] or '0')
%(whole)s
if not (whole(epoch) and whole(version) and whole(pruned)) then return 'corrupt ' .. meta end
local kept = version - pruned
if redis.call('HEXISTS', ops, ARGV[4]) == 1 or epoch ~= tonumber(ARGV[2])
   or version ~= tonumber(ARGV[1]) then
  return 'refused'
end
if redis.call('LLEN', log) ~= kept then return 'corrupt ' .. log end
if redis.call('LLEN', sums) ~= kept then return 'corrupt ' .. sums end
redis.call('RPUSH', log, ARGV[5])
redis.call('RPUSH', sums, ARGV[6])
redis.call('HSET', ops, ARGV[4], ARGV[7])
if ARGV[14] ~= '' then
  redis.call('HSET', meta, 'epoch', tostring(epoch + 1), 'owner', ARGV[14])
end
redis.call('HSET', meta, 'frontier', ARGV[8], 'checksum', ARGV[9], 'head', ARGV[6],
           'version', tostring(version + 1), 'run_id', ARGV[10], 'ended', ARGV[11])
for i = 5, 8 do
  if not broken[i] then redis.call('HDEL', KEYS[i], ARGV[12]) end
end
local listed = 4 + tonumber(ARGV[13])
if not broken[listed] then redis.call('HSET', KEYS[listed], ARGV[12], ARGV[15]) end
if ARGV[13] == '1' and not broken[9] then redis.call('HSET', KEYS[9], ARGV[12], '1') end
if #broken.keys > 0 then return {'ok', unpack(broken.keys)} end
return 'ok'
""".replace("%(whole)s", _WHOLE).replace("%(typed)s", TYPED)

# KEYS: meta sums runs:running runs:awaiting runs:ended owner:OLD owner:NEW instance
# ARGV: supersedes, owner, thread, owner as JSON, the version the claimer loaded, the
# instance token ('' checks nothing).
# The run-index entry is the last append's summary with the owner patched in: it ends
# with the owner, RunSummary's last field (a string holds no bare `,"owner":`); an entry
# that does not end in a JSON string or null there is reported, never rewritten.
# The reply: {'ok', N, the N shared indexes of another type left unwritten (as in an
# append: a run index holds no entry then, so nothing of it is patched), then, if appends
# moved the thread since the claimer's load, what they left (version, frontier,
# checksum, head, hash-list length, last hash, anchor) to verify}.
CLAIM_LUA = r"""#!lua
local meta, sums, thread = KEYS[1], KEYS[2], ARGV[3]
if ARGV[6] ~= '' and redis.call('GET', KEYS[8]) ~= ARGV[6] then return {'lost'} end
local want = {'hash', 'list', 'hash', 'hash', 'hash', 'hash', 'hash'}
%(typed)s
local typed_ok, broken = typed(7, 3)
if not typed_ok then return {'corrupt', broken} end
local f = redis.call('HMGET', meta, 'epoch', 'version', 'frontier', 'checksum', 'head',
                     'pruned', 'pruned_hash')
local epoch, version = tonumber(f[1] or '0'), tonumber(f[2] or '0')
%(whole)s
if not (whole(epoch) and whole(version)) then return {'corrupt', meta} end
if epoch ~= tonumber(ARGV[1]) then return {'fenced', tostring(epoch)} end
local state, entry = 0, nil
for i = 3, 5 do
  local s = not broken[i] and redis.call('HGET', KEYS[i], thread)
  if s then
    local at, from = nil, 1
    repeat
      local found = string.find(s, ',"owner":', from, true)
      if found then at, from = found, found + 1 end
    until not found
    local tail = at and string.gsub(string.sub(s, at + 9), '\\.', '')
    if not tail or (tail ~= 'null}' and not string.find(tail, '^"[^"]*"}$')) then
      return {'corrupt', KEYS[i]}
    end
    state, entry = i - 2, string.sub(s, 1, at + 8) .. ARGV[4] .. '}'
  end
end
redis.call('HSET', meta, 'epoch', tostring(epoch + 1), 'owner', ARGV[2])
if state > 0 then redis.call('HSET', KEYS[2 + state], thread, entry) end
-- no entry read (a run index of another type may have held it): another host's owner
-- index still must not list it, whatever its state
if not broken[6] and (state > 0 or KEYS[6] ~= KEYS[7]) then
  redis.call('HDEL', KEYS[6], thread)
end
if state == 1 and not broken[7] then redis.call('HSET', KEYS[7], thread, '1') end
local reply = {'ok', #broken.keys, unpack(broken.keys)}
if version == tonumber(ARGV[5]) then return reply end
for _, v in ipairs({f[2] or '0', f[3] or false, f[4] or false, f[5] or false,
                    redis.call('LLEN', sums), redis.call('LINDEX', sums, -1) or false,
                    f[6] or '0', f[7] or false}) do
  table.insert(reply, v)
end
return reply
""".replace("%(whole)s", _WHOLE).replace("%(typed)s", TYPED)

# KEYS: meta log sums ops history
# ARGV: the anchor as read, the seq to prune through, the stored hash there, the pruned
# history's digest as read and after, the number M of messages removed, the messages the
# pruned history holds as read, then those M messages and the operation ids of the
# records removed. 'moved': the anchor, digest or record is not as read; 'stray N': the
# anchor is as read and the history holds N messages, not as many (added by hand).
PRUNE_LUA = """#!lua
local meta, log, sums, ops, history = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local want = {'hash', 'list', 'list', 'hash', 'list'}
for i = 1, 5 do
  local t = redis.call('TYPE', KEYS[i])['ok']
  if t ~= 'none' and t ~= want[i] then return 'corrupt ' .. KEYS[i] end
end
local f = redis.call('HMGET', meta, 'version', 'pruned', 'pruned_digest')
local version, pruned = tonumber(f[1] or '0'), tonumber(f[2] or '0')
if not version or not pruned then return 'corrupt ' .. meta end
local after, through, m = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[6])
local n = through - after
if pruned ~= after or (f[3] or '') ~= ARGV[4] or through > version
   or redis.call('LINDEX', sums, n - 1) ~= ARGV[3] then
  return 'moved'
end
local held = redis.call('LLEN', history)
if held ~= tonumber(ARGV[7]) then return 'stray ' .. held end
redis.call('LTRIM', log, n, -1)
redis.call('LTRIM', sums, n, -1)
for i = 8, 7 + m, 1000 do
  redis.call('RPUSH', history, unpack(ARGV, i, math.min(i + 999, 7 + m)))
end
for i = 8 + m, #ARGV, 1000 do
  redis.call('HDEL', ops, unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('HSET', meta, 'pruned', ARGV[2], 'pruned_hash', ARGV[3], 'pruned_digest', ARGV[5])
return 'ok'
"""

# KEYS: lease instance. ARGV: holder, ttl in ms, the instance token ('' checks nothing),
# the longest TTL in ms any holder sets. The store's lease (``CommitStore.hold_lease``),
# timed by the server's clock: taken if free, the holder's own, without a TTL or with
# one longer than any holder sets (set by hand); else left, and its holder and
# milliseconds left answered.
LEASE_LUA = """#!lua
if ARGV[3] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[3] then return 'lost' end
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'none' and t ~= 'string' then return 'corrupt' end
local held = redis.call('GET', KEYS[1])
local left = redis.call('PTTL', KEYS[1])
if held and held ~= ARGV[1] and left >= 0 and left <= tonumber(ARGV[4]) then
  return {held, left}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {ARGV[1], tonumber(ARGV[2])}
"""

# KEYS: lease. ARGV: holder. Gives the lease up if the holder holds it.
UNLEASE_LUA = """#!lua
if redis.call('TYPE', KEYS[1])['ok'] == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
return 1
"""
