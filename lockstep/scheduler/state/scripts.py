"""What each Lua script of the state layer may do while Redis is out of memory.

Redis runs with `maxmemory-policy noeviction` (docs/operations.md, "Redis memory"): at its
limit it refuses writes instead of dropping a key. A script without a shebang would be refused
at its first growing write, after the writes and deletions it already made, and Redis never
rolls a script back. So every script declares itself (Redis 7 script flags):

- `WRITES`: refused whole while Redis is full, so never half-applied (a claim, a commit, a
  finish: each runs again once Redis has room, and nothing of it was recorded meanwhile);
- `READS`: reads only, served whatever the memory;
- `FREES`: reads and deletions only (what frees memory), served whatever the memory.
"""

WRITES = "#!lua\n"
READS = "#!lua flags=no-writes\n"
FREES = "#!lua flags=allow-oom\n"
