package throttle

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// MinRedisVersion is the oldest Redis the limiter's script runs on: it uses ZADD GT (a
// pause never ends earlier) and PEXPIRE NX and GT (a shared key's TTL only grows), both
// of Redis 7.0. On Redis 6 the script fails on the first reservation or pause, so every
// task that must wait would fail closed.
const MinRedisVersion = "7.0"

// ErrRedisVersion is matched (errors.Is) by the error CheckServer returns for a Redis
// older than MinRedisVersion.
var ErrRedisVersion = errors.New("throttle: Redis too old for the limiter")

// CheckServer reads the version of the Redis server the limiter runs its script on (INFO
// server; on a Redis Cluster, of one node: a cluster runs one version) and returns an
// error matching ErrRedisVersion if it is older than MinRedisVersion. It returns nil if
// the version cannot be read (INFO forbidden by ACL, or an embedded server such as
// miniredis that has no server section): the check refuses only a server known to be too
// old. Package worker calls it from New.
func (l *Limiter) CheckServer(ctx context.Context) error {
	info, err := l.rdb.Info(ctx, "server").Result()
	if err != nil {
		return nil
	}
	v, ok := redisVersion(info)
	if !ok || !olderThan(v, MinRedisVersion) {
		return nil
	}
	return fmt.Errorf("%w: the server runs Redis %s; the script needs %s or later (ZADD GT, PEXPIRE NX and GT)", ErrRedisVersion, v, MinRedisVersion)
}

// redisVersion returns the redis_version field of an INFO reply.
func redisVersion(info string) (string, bool) {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok && v != "" {
			return v, true
		}
	}
	return "", false
}

// olderThan reports whether version v ("6.2.14") is older than min ("7.0"), comparing
// their dot-separated numbers in order; a part that is not a number ends the comparison
// (not older).
func olderThan(v, min string) bool {
	vs, ms := strings.Split(v, "."), strings.Split(min, ".")
	for i, m := range ms {
		mn, err := strconv.Atoi(m)
		if err != nil || i >= len(vs) {
			return false
		}
		vn, err := strconv.Atoi(vs[i])
		if err != nil {
			return false
		}
		if vn != mn {
			return vn < mn
		}
	}
	return false
}
