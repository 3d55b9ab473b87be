"""Lua scripts behind every scheduler state transition (run atomically inside Redis).

Each transition that touches more than one key is one script, so a scheduler killed at any
instant leaves Redis either before or after the transition, never half-way. The key layout is
owned by ``state.py``: scripts get fixed keys in KEYS and, where a transition touches keys named
after ids found inside Redis (an expired lease names its execution and job), the key prefixes in
ARGV. That makes them single-instance scripts (not Redis Cluster), which is how Gyre runs Redis.

Conventions: times are integer milliseconds since the epoch, passed in by the caller (so the
caller's clock is the one clock); a script returns ``{code, ...}`` with ``code`` > 0 for success,
``2`` for an idempotent repeat and negative codes for refusals that the caller maps to errors.
Event streams are trimmed approximately (``MAXLEN ~``).
"""

from __future__ import annotations

# Shared Lua helpers, prepended to every script.
_PRELUDE = r"""
local function xadd(stream, maxlen, now, kind, ...)
  return redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'kind', kind, 'ts_ms', now, ...)
end
"""

# KEYS: job, jobs_index, events, active   ARGV: job_id, now, maxlen, then flat field/value pairs
SUBMIT_JOB = _PRELUDE + r"""
if redis.call('EXISTS', KEYS[1]) == 1 then return {-1} end
redis.call('SADD', KEYS[4], ARGV[1])
local now = tonumber(ARGV[2])
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('HSET', KEYS[1], 'created_ms', now, 'updated_ms', now)
redis.call('ZADD', KEYS[2], now, ARGV[1])
local id = xadd(KEYS[3], ARGV[3], now, 'job_submitted', 'state', 'pending')
return {1, id}
"""

# KEYS: job, events, active   ARGV: from_state, to_state, now, maxlen, message, job_id
SET_JOB_STATE = _PRELUDE + r"""
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {-1} end
if st == ARGV[2] then return {2, st} end
if st ~= ARGV[1] then return {-2, st} end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'updated_ms', ARGV[3], 'message', ARGV[5])
if ARGV[2] ~= 'pending' and ARGV[2] ~= 'running' then redis.call('SREM', KEYS[3], ARGV[6]) end
xadd(KEYS[2], ARGV[4], ARGV[3], 'job_state', 'state', ARGV[2], 'message', ARGV[5])
return {1, st}
"""

# KEYS: job, queue, events   ARGV: step, exec_prefix, now, maxlen, job_id, then triples
# (execution_id, group_id, payload). Enqueues step `step` iff it is the next one to enqueue.
ENQUEUE_STEP = _PRELUDE + r"""
local st, enq = unpack(redis.call('HMGET', KEYS[1], 'state', 'enqueued_steps'))
if not st then return {-1} end
if st ~= 'running' then return {-2, st} end
local step = tonumber(ARGV[1])
if tonumber(enq) ~= step then return {2, enq} end
local n = 0
for i = 6, #ARGV, 3 do
  local eid = ARGV[i]
  redis.call('HSET', ARGV[2] .. eid, 'job_id', ARGV[5], 'step', step, 'group_id', ARGV[i + 1],
             'payload', ARGV[i + 2], 'state', 'queued', 'attempt', 0, 'token', '')
  redis.call('ZADD', KEYS[2], step, eid)
  n = n + 1
end
redis.call('HSET', KEYS[1], 'enqueued_steps', step + 1, 'updated_ms', ARGV[3])
xadd(KEYS[3], ARGV[4], ARGV[3], 'step_started', 'step', step, 'executions', n)
return {1, n}
"""

# KEYS: job, queue, events   ARGV: round, exec_prefix, now, maxlen, job_id, after_step, weight_version,
# then pairs (execution_id, payload). Enqueues evaluation round `round` once (queue score -1:
# leased before any rollout); its executions count in eval_done:{round}, not in any step.
ENQUEUE_EVAL = _PRELUDE + r"""
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {-1} end
if st ~= 'running' then return {-2, st} end
local round = ARGV[1]
if redis.call('HSETNX', KEYS[1], 'eval_size:' .. round, (#ARGV - 7) / 2) == 0 then return {2} end
local n = 0
for i = 8, #ARGV, 2 do
  local eid = ARGV[i]
  redis.call('HSET', ARGV[2] .. eid, 'job_id', ARGV[5], 'step', ARGV[6], 'group_id', 'eval' .. round,
             'payload', ARGV[i + 1], 'state', 'queued', 'attempt', 0, 'token', '', 'eval_round', round)
  redis.call('ZADD', KEYS[2], -1, eid)
  n = n + 1
end
redis.call('HSET', KEYS[1], 'updated_ms', ARGV[3], 'eval_version:' .. round, ARGV[7])
xadd(KEYS[3], ARGV[4], ARGV[3], 'evaluation_started', 'round', round, 'after_step', ARGV[6],
     'weight_version', ARGV[7], 'tasks', n)
return {1, n}
"""

# KEYS: job, queue, running, leases   ARGV: exec_prefix, now, ttl_ms, token, harness_id
LEASE = r"""
local st, timeout_ms = unpack(redis.call('HMGET', KEYS[1], 'state', 'execution_timeout_ms'))
if not st then return {-1} end
if st ~= 'running' then return {0, st} end
local popped = redis.call('ZPOPMIN', KEYS[2])
if #popped == 0 then return {0, 'empty'} end
local eid = popped[1]
local ek = ARGV[1] .. eid
local now = tonumber(ARGV[2])
local expires = now + tonumber(ARGV[3])
local deadline = now + tonumber(timeout_ms)
local attempt = redis.call('HINCRBY', ek, 'attempt', 1)
redis.call('HSET', ek, 'state', 'leased', 'token', ARGV[4], 'harness_id', ARGV[5],
           'lease_expires_ms', expires, 'deadline_ms', deadline, 'leased_ms', now)
redis.call('HDEL', ek, 'lease_released')
redis.call('ZADD', KEYS[4], expires, eid)
redis.call('SADD', KEYS[3], eid)
if ARGV[6] ~= '' then redis.call('SET', ARGV[6], eid, 'PX', ARGV[3]) end  -- the request's answer
local f = redis.call('HMGET', ek, 'step', 'group_id', 'payload', 'eval_round')
return {1, eid, attempt, deadline, expires, f[1], f[2], f[3], f[4] or ''}
"""

# KEYS: exec, leases, running, queue, job   ARGV: token, now, ttl_ms, execution_id
# Extends a lease. A lease that expired but was not leased again is revived (same token), unless its
# harness gave it up (ReleaseHarness).
HEARTBEAT = r"""
local st, tok, deadline, released = unpack(redis.call('HMGET', KEYS[1], 'state', 'token', 'deadline_ms',
                                                      'lease_released'))
if not st then return {-1} end
if tok ~= ARGV[1] or released then return {-2, st} end  -- a released lease was given up for good
if st == 'queued' then
  if redis.call('ZREM', KEYS[4], ARGV[4]) == 0 then return {-3, st} end
  redis.call('SADD', KEYS[3], ARGV[4])
elseif st ~= 'leased' then
  return {-3, st}
end
local expires = tonumber(ARGV[2]) + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'state', 'leased', 'lease_expires_ms', expires)
redis.call('ZADD', KEYS[2], expires, ARGV[4])
local jst = redis.call('HGET', KEYS[5], 'state')
local cancelled = 0
if jst == 'cancelled' or jst == 'failed' then cancelled = 1 end
return {1, deadline, expires, cancelled}
"""

# Records the end of an execution and advances the job's per-step counters.
# KEYS: exec, leases, running, queue, job, events
# ARGV: token, status, now, retention_ms, maxlen, execution_id, reason
_FINISH_EXEC = r"""
local function finish_exec(ek, jk, events, eid, status, now, retention, maxlen, reason, token)
  local step, gid, attempt, job_id, round = unpack(redis.call('HMGET', ek, 'step', 'group_id', 'attempt', 'job_id',
      'eval_round'))
  redis.call('HSET', ek, 'state', status, 'completion_token', token, 'completed_ms', now, 'reason', reason)
  if tonumber(retention) > 0 then redis.call('PEXPIRE', ek, retention) end
  if round then
    -- a held-out evaluation execution: counted per round, never in the step's counters
    local edone = redis.call('HINCRBY', jk, 'eval_done:' .. round, 1)
    redis.call('HINCRBY', jk, 'eval_n_' .. status .. ':' .. round, 1)
    xadd(events, maxlen, now, 'execution_completed', 'execution_id', eid, 'step', step, 'group_id', gid,
         'status', status, 'attempt', attempt, 'reason', reason, 'evaluation', round)
    return edone
  end
  redis.call('HINCRBY', jk, 'n_' .. status, 1)
  local done = redis.call('HINCRBY', jk, 'done:' .. step, 1)
  xadd(events, maxlen, now, 'execution_completed', 'execution_id', eid, 'step', step, 'group_id', gid,
       'status', status, 'attempt', attempt, 'reason', reason)
  local group_size, groups = unpack(redis.call('HMGET', jk, 'group_size', 'groups_per_step'))
  local gdone = redis.call('HINCRBY', jk, 'gdone:' .. step .. ':' .. gid, 1)
  if gdone == tonumber(group_size) then
    redis.call('HDEL', jk, 'gdone:' .. step .. ':' .. gid)
    redis.call('HINCRBY', jk, 'groups_done:' .. step, 1)
    xadd(events, maxlen, now, 'group_done', 'step', step, 'group_id', gid)
  end
  if done == tonumber(group_size) * tonumber(groups) then
    xadd(events, maxlen, now, 'step_rollouts_done', 'step', step)
  end
  return done
end
"""

COMPLETE = _PRELUDE + _FINISH_EXEC + r"""
local st, tok, ctok = unpack(redis.call('HMGET', KEYS[1], 'state', 'token', 'completion_token'))
if not st then return {-1} end
if st ~= 'queued' and st ~= 'leased' then
  if ctok == ARGV[1] then return {2, st} end
  return {-2, st}
end
if tok ~= ARGV[1] then return {-2, st} end
local eid = ARGV[6]
if st == 'queued' then
  -- the lease expired and was re-queued, but nobody leased it again: the holder's result stands
  if redis.call('ZREM', KEYS[4], eid) == 0 then return {-3, st} end
end
redis.call('ZREM', KEYS[2], eid)
redis.call('SREM', KEYS[3], eid)
local done = finish_exec(KEYS[1], KEYS[5], KEYS[6], eid, ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[7], ARGV[1])
return {1, st, done}
"""

# Re-queues executions whose lease expired; after max_attempts ends them as timeouts and puts
# them in the score outbox (execution_id -> {job_id, step, group_id}) for the reward service.
# KEYS: leases, score_outbox   ARGV: now, limit, exec_prefix, job_prefix, retention_ms, maxlen
# A job's queue/running/events keys are job_prefix .. job_id .. ':queue' etc. (see state.Keys).
REAP = _PRELUDE + _FINISH_EXEC + r"""
local now = tonumber(ARGV[1])
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, eid in ipairs(expired) do
  local ek = ARGV[3] .. eid
  redis.call('ZREM', KEYS[1], eid)
  local st, job_id, step, attempt = unpack(redis.call('HMGET', ek, 'state', 'job_id', 'step', 'attempt'))
  if st == 'leased' then
    local jk = ARGV[4] .. job_id
    redis.call('SREM', jk .. ':running', eid)
    local jst, max_attempts = unpack(redis.call('HMGET', jk, 'state', 'max_attempts'))
    local events = jk .. ':events'
    if jst ~= 'running' then
      redis.call('HSET', ek, 'state', 'cancelled', 'reason', 'lease expired after the job ended')
      if tonumber(ARGV[5]) > 0 then redis.call('PEXPIRE', ek, ARGV[5]) end
      out[#out + 1] = eid; out[#out + 1] = 'cancelled'
    elseif tonumber(attempt) >= tonumber(max_attempts) then
      -- the last allowed attempt went silent: it ends as a timeout, and the reward service scores
      -- it from its preserved workspace under the job's policy (the orchestrator drains the outbox)
      local gid, round = unpack(redis.call('HMGET', ek, 'group_id', 'eval_round'))
      finish_exec(ek, jk, events, eid, 'timeout', now, ARGV[5], ARGV[6],
                  'lease expired ' .. attempt .. ' times (last allowed attempt)', '')
      redis.call('HSET', KEYS[2], eid, cjson.encode({job_id = job_id, step = tonumber(step), group_id = gid,
                                                     evaluation = round and 1 or 0}))
      out[#out + 1] = eid; out[#out + 1] = 'timeout'
    else
      redis.call('HSET', ek, 'state', 'queued')
      local prio = tonumber(step)
      if redis.call('HEXISTS', ek, 'eval_round') == 1 then prio = -1 end
      redis.call('ZADD', jk .. ':queue', prio, eid)
      redis.call('HINCRBY', jk, 'n_requeued', 1)
      xadd(events, ARGV[6], now, 'execution_requeued', 'execution_id', eid, 'step', step, 'attempt', attempt)
      out[#out + 1] = eid; out[#out + 1] = 'requeued'
    end
  end
end
return out
"""

# Grace after a leadership change: every lease expiring before ARGV[1] is extended to it, so
# holders that could not heartbeat while no scheduler ran get a full TTL to reach the new one.
# KEYS: leases   ARGV: until_ms, exec_prefix
GRACE_LEASES = r"""
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
local n = 0
for _, eid in ipairs(ids) do
  if redis.call('HEXISTS', ARGV[2] .. eid, 'lease_released') == 0 then  -- a released lease stays given up
    redis.call('ZADD', KEYS[1], ARGV[1], eid)
    redis.call('HSET', ARGV[2] .. eid, 'lease_expires_ms', ARGV[1])
    n = n + 1
  end
end
return n
"""

# KEYS: leases   ARGV: exec_prefix, harness_id, now
# Ends every lease held by harness_id now (its process restarted: they can never be renewed); the
# reaper re-queues them (or ends them as timeouts after max_attempts) on its next pass.
RELEASE_HARNESS = r"""
local out = {}
for _, eid in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local ek = ARGV[1] .. eid
  local st, holder = unpack(redis.call('HMGET', ek, 'state', 'harness_id'))
  if st == 'leased' and holder == ARGV[2] then
    redis.call('ZADD', KEYS[1], ARGV[3], eid)
    redis.call('HSET', ek, 'lease_expires_ms', ARGV[3], 'lease_released', '1')  -- no grace re-extends it
    out[#out + 1] = eid
  end
end
return out
"""

# KEYS: job, queue, running, events, active   ARGV: now, maxlen, exec_prefix, retention_ms, message, job_id
CANCEL_JOB = _PRELUDE + r"""
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {-1} end
if st == 'cancelled' then return {2, st} end
if st == 'completed' or st == 'failed' then return {-2, st} end
local queued = redis.call('ZRANGE', KEYS[2], 0, -1)
for _, eid in ipairs(queued) do
  local ek = ARGV[3] .. eid
  redis.call('HSET', ek, 'state', 'cancelled', 'reason', 'job cancelled')
  if tonumber(ARGV[4]) > 0 then redis.call('PEXPIRE', ek, ARGV[4]) end
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'updated_ms', ARGV[1], 'message', ARGV[5])
redis.call('SREM', KEYS[5], ARGV[6])
xadd(KEYS[4], ARGV[2], ARGV[1], 'job_state', 'state', 'cancelled', 'message', ARGV[5],
     'dropped_queued', #queued, 'running', redis.call('SCARD', KEYS[3]))
return {1, #queued}
"""

# KEYS: job, events, active   ARGV: step, phase ('started'|'published'), weight_version, now, maxlen, job_id,
# tokens, compute_s, world_size, then name/value pairs of the step's figures
REPORT_TRAINING = _PRELUDE + r"""
local st, cur, nsteps, gsize, groups = unpack(redis.call('HMGET', KEYS[1], 'state', 'current_step',
    'num_steps', 'group_size', 'groups_per_step'))
if not st then return {-1} end
local step = tonumber(ARGV[1])
cur = tonumber(cur)
if step < cur then return {2, cur} end
if st ~= 'running' then return {-2, st} end
if step > cur then return {-3, cur} end
local now = ARGV[4]
if ARGV[2] == 'started' then
  redis.call('HSET', KEYS[1], 'training_step', step, 'updated_ms', now)
  xadd(KEYS[2], ARGV[5], now, 'training_started', 'step', step)
  return {1, cur}
end
local done = tonumber(redis.call('HGET', KEYS[1], 'done:' .. step) or '0')
local size = tonumber(gsize) * tonumber(groups)
if done < size then return {-4, done, size} end
local version = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'current_step', step + 1, 'weight_version', version, 'training_step', -1,
           'updated_ms', now)
local trained = {'step', step, 'weight_version', version}
if tonumber(ARGV[7] or '0') > 0 and tonumber(ARGV[8] or '0') > 0 then
  -- what the update measured (tokens, compute seconds, world size): the policy's cost model
  redis.call('HSET', KEYS[1], 'train:' .. step, ARGV[7] .. ' ' .. ARGV[8] .. ' ' .. ARGV[9])
  for _, v in ipairs({'trained_tokens', ARGV[7], 'compute_s', ARGV[8], 'world_size', ARGV[9]}) do
    trained[#trained + 1] = v
  end
end
for i = 10, #ARGV do trained[#trained + 1] = ARGV[i] end  -- the step's figures: trainer.<name>, value
xadd(KEYS[2], ARGV[5], now, 'step_trained', unpack(trained))
if step + 1 >= tonumber(nsteps) and redis.call('HGET', KEYS[1], 'hold_completion') == '1' then
  -- the job controller completes it after the final evaluation
  redis.call('HSET', KEYS[1], 'training_done', 1)
elseif step + 1 >= tonumber(nsteps) then
  redis.call('HSET', KEYS[1], 'state', 'completed', 'message', 'all steps trained')
  redis.call('SREM', KEYS[3], ARGV[6])
  xadd(KEYS[2], ARGV[5], now, 'job_state', 'state', 'completed', 'message', 'all steps trained')
end
return {1, step + 1}
"""

# KEYS: cell, cells   ARGV: cell_id, now, role, then flat field/value pairs (static fields)
# A re-registering cell keeps a pending switch (recovery settles it); otherwise its reported
# role becomes the registry role.
REGISTER_CELL = r"""
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
local role = redis.call('HGET', KEYS[1], 'role')
local fresh = 0
if not role then
  fresh = 1
  redis.call('HSET', KEYS[1], 'registered_ms', ARGV[2])
end
redis.call('HSET', KEYS[1], 'heartbeat_ms', ARGV[2], 'reported_role', ARGV[3], unpack(fields))
if role ~= 'switching' then redis.call('HSET', KEYS[1], 'role', ARGV[3]) end
redis.call('SADD', KEYS[2], ARGV[1])
return {1, fresh}
"""

# KEYS: cell   ARGV: reason ('' uncordons)
CORDON_CELL = r"""
local role, core = unpack(redis.call('HMGET', KEYS[1], 'role', 'is_core'))
if not role then return -1 end
if core == '1' then return -2 end
if ARGV[1] == '' then redis.call('HDEL', KEYS[1], 'cordon_reason')
else redis.call('HSET', KEYS[1], 'cordon_reason', ARGV[1]) end
return 1
"""

# KEYS: cell   ARGV: now, inflight, kv_used, kv_capacity, weight_version, reported_role
CELL_HEARTBEAT = r"""
local role, sto = unpack(redis.call('HMGET', KEYS[1], 'role', 'switch_to'))
if not role then return {-1} end
redis.call('HSET', KEYS[1], 'heartbeat_ms', ARGV[1], 'inflight', ARGV[2], 'kv_used_tokens', ARGV[3],
           'kv_capacity_tokens', ARGV[4], 'weight_version', ARGV[5], 'reported_role', ARGV[6])
return {1, role, sto or ''}
"""

# KEYS: cell, cells, switches   ARGV: cell_id
DEREGISTER_CELL = r"""
local role = redis.call('HGET', KEYS[1], 'role')
if not role then return {-1} end
if role == 'switching' then return {-2, role} end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return {1, role}
"""

# KEYS: cell, switches, events   ARGV: cell_id, from_role, to_role, switch_id, now, maxlen, job_id,
# reason, migrate_to (comma-separated)
BEGIN_SWITCH = _PRELUDE + r"""
local role, is_core = unpack(redis.call('HMGET', KEYS[1], 'role', 'is_core'))
if not role then return {-1} end
if is_core == '1' then return {-3, role} end
if role ~= ARGV[2] then return {-2, role} end
redis.call('HSET', KEYS[1], 'role', 'switching', 'switch_from', ARGV[2], 'switch_to', ARGV[3],
           'switch_id', ARGV[4], 'switch_started_ms', ARGV[5], 'switch_job_id', ARGV[7],
           'switch_migrate_to', ARGV[9])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
xadd(KEYS[3], ARGV[6], ARGV[5], 'switch_started', 'cell_id', ARGV[1], 'from', ARGV[2], 'to', ARGV[3],
     'switch_id', ARGV[4], 'reason', ARGV[8], 'migrate_to', ARGV[9])
return {1}
"""

# KEYS: cell, switches, events, switch_log   ARGV: cell_id, switch_id, now, outcome ('done'|'rolled_back'),
# maxlen, error
END_SWITCH = _PRELUDE + r"""
local role, sid, from, to, started, last = unpack(redis.call('HMGET', KEYS[1], 'role', 'switch_id',
    'switch_from', 'switch_to', 'switch_started_ms', 'last_switch_id'))
if not role then return {-1} end
if role ~= 'switching' or sid ~= ARGV[2] then
  if last == ARGV[2] then return {2, role} end
  return {-2, role}
end
local now = tonumber(ARGV[3])
local dur = now - tonumber(started)
local final = to
local kind = 'switch_finished'
if ARGV[4] ~= 'done' then final = from; kind = 'switch_rolled_back' end
redis.call('HSET', KEYS[1], 'role', final, 'last_switch_id', sid, 'last_switch_ms', dur)
redis.call('HDEL', KEYS[1], 'switch_id', 'switch_from', 'switch_to', 'switch_started_ms', 'switch_job_id',
           'switch_migrate_to')
redis.call('ZREM', KEYS[2], ARGV[1])
local attrs = {'cell_id', ARGV[1], 'from', from, 'to', to, 'switch_id', sid, 'duration_ms', dur,
               'outcome', ARGV[4], 'error', ARGV[6]}
xadd(KEYS[3], ARGV[5], now, kind, unpack(attrs))
xadd(KEYS[4], ARGV[5], now, kind, unpack(attrs))
return {1, final, dur}
"""

# Everything the orchestrator needs about one job, in one round trip.
# KEYS: job, queue, running   ARGV: none. Returns flat job fields then counts.
JOB_SNAPSHOT = r"""
local cur = redis.call('HGET', KEYS[1], 'current_step')
if not cur then return {} end
local f = redis.call('HMGET', KEYS[1], 'state', 'spec', 'created_ms', 'updated_ms', 'current_step',
    'weight_version', 'enqueued_steps', 'training_step', 'done:' .. cur, 'groups_done:' .. cur,
    'n_finished', 'n_timeout', 'n_failed', 'n_requeued', 'message')
f[#f + 1] = redis.call('ZCARD', KEYS[2])
f[#f + 1] = redis.call('SCARD', KEYS[3])
return f
"""

# KEYS: leader   ARGV: instance_id, ttl_ms. Take or extend the orchestrator leadership.
ACQUIRE_LEADER = r"""
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# KEYS: leader   ARGV: instance_id
RELEASE_LEADER = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
