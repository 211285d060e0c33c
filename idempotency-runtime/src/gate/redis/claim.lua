local now = tonumber(ARGV[4])
for i = 2, 3 do
  local v = redis.pcall('HGET', KEYS[i], ARGV[3])
  if type(v) == 'table' then
    redis.call('DEL', KEYS[i])
  elseif v then
    local tag = string.byte(v)
    if #v < 23 or (tag ~= 100 and tag ~= 102) or v == ARGV[6] then
      redis.call('HDEL', KEYS[i], ARGV[3])
    else
      local a, b, c, d, e, f = string.byte(v, 2, 7)
      if ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f > now then
        if i == 3 then
          redis.call('HSET', KEYS[2], ARGV[3], v)
          if redis.call('PTTL', KEYS[2]) < 0 then redis.call('PEXPIRE', KEYS[2], ARGV[5]) end
        end
        return v
      end
    end
  end
end
local held = redis.pcall('GET', KEYS[1])
if held == ARGV[1] then return false end
if type(held) == 'string' and string.sub(held, 1, 2) == 'p:' and redis.call('PTTL', KEYS[1]) >= 0 then
  return held
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
