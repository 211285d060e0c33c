if redis.pcall('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if type(redis.pcall('HSET', KEYS[2], ARGV[2], ARGV[3])) == 'table' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
end
if redis.call('PTTL', KEYS[2]) < 0 then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
if ARGV[5] == '1' then redis.call('PUBLISH', KEYS[1], '') end
return 1
