package throttle

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/lua"
)

// DefaultReplicaTimeout is Config.ReplicaTimeout when left zero. A WAIT that blocks makes
// the primary ask its replicas for their offsets (REPLCONF GETACK), and a replica on the
// same network answers within a millisecond or two (0.1-1ms on loopback in the tests), so
// 100ms means a replica that is down, cut off or still loading its first sync, and it is
// all a decision waits when one is.
const DefaultReplicaTimeout = 100 * time.Millisecond

// ErrNotReplicated matches, under errors.Is, the error Allow and AllowAt return in durable
// mode (Config.MinReplicas > 0) for an admission that fewer than MinReplicas replicas
// acknowledged within Config.ReplicaTimeout. The admission was written on the primary but
// may be lost in a failover, so it is not reported as one: the task must not run (package
// worker treats the error as Redis being unavailable: it asks again with the same event id,
// then re-queues the task without counting a failure). The error is a
// *NotReplicatedError, with the counts.
var ErrNotReplicated = errors.New("throttle: admission not acknowledged by enough replicas")

// NotReplicatedError reports an admission that WAIT did not see reach MinReplicas
// replicas. Read it with errors.As; errors.Is(err, ErrNotReplicated) is true.
type NotReplicatedError struct {
	Key      Key           // the event's task type and tenant
	Acked    int           // replicas that acknowledged it (WAIT's reply)
	Want     int           // Config.MinReplicas
	Timeout  time.Duration // Config.ReplicaTimeout, how long WAIT waited
	Replayed bool          // the call repeated an admission made before (Decision.Replay)
}

// Error names the event, the replicas that acknowledged it and the ones wanted, and how
// long WAIT waited.
func (e *NotReplicatedError) Error() string {
	what := "admission"
	if e.Replayed {
		what = "repeated admission"
	}
	return fmt.Sprintf("throttle: %s of %s for tenant %s: %d of %d replicas acknowledged it within %s (WAIT)",
		what, quote.Name(e.Key.TaskType), quote.Quote(e.Key.Tenant), e.Acked, e.Want, e.Timeout)
}

// Is reports whether target is ErrNotReplicated.
func (e *NotReplicatedError) Is(target error) bool { return target == ErrNotReplicated }

// ackKeyWord follows a task type's hash tag in the key that a repeated call writes in
// durable mode (see scriptDurable): "<prefix>:{<task type>}:ack". No log, set or hash of
// the type has this word there.
const ackKeyWord = "ack"

// ackKeyTTL is the TTL of that key: it holds nothing anyone reads.
const ackKeyTTL = time.Second

// script runs the sliding-window script with keys and args. Without durable mode it is
// one EVALSHA (EVAL on NOSCRIPT), through the autopipeliner if there is one, and acked is
// -1. In durable mode it is scriptDurable: acked is how many replicas acknowledged every
// write the call made.
func (l *Limiter) script(ctx context.Context, taskType string, repeat bool, keys []string, args []any) (r []int64, acked int, err error) {
	if l.minReplicas <= 0 {
		r, err = lua.SlidingWindow.Run(ctx, l.run, keys, args...).Int64Slice()
		return r, -1, err
	}
	return l.scriptDurable(ctx, taskType, repeat, keys, args)
}

// scriptDurable sends EVALSHA and then "WAIT <MinReplicas> <ReplicaTimeout ms>" in one
// pipeline on one connection, to the primary that holds keys (on a Redis Cluster, the
// master of their slot): WAIT counts the replicas that acknowledged the writes of its own
// connection, up to its last one, so the two must share a connection, and WAIT must
// reach the node the script wrote to. On NOSCRIPT (a restarted or newly promoted primary
// has an empty script cache) it sends the pipeline again with EVAL.
//
// A repeated call (repeat: not Request.Fresh) may be a replay, which writes nothing: its
// connection's last write could then be older than the admission it replays, and WAIT
// would count replicas that never got that admission. So a repeat also sets the type's
// ack key between the two: a write after the admission it may replay, on the same node,
// which the replicas acknowledge only once they have everything before it.
func (l *Limiter) scriptDurable(ctx context.Context, taskType string, repeat bool, keys []string, args []any) ([]int64, int, error) {
	node, err := l.nodeFor(ctx, keys[0])
	if err != nil {
		return nil, 0, err
	}
	waitMS := l.replicaTimeout.Milliseconds()
	// send's pipeline error is its first command's, or a transport error that every
	// command carries: read each command's own.
	send := func(eval bool) (run, wait *redis.Cmd) {
		_, _ = node.Pipelined(ctx, func(p redis.Pipeliner) error {
			if eval {
				run = lua.SlidingWindow.Eval(ctx, p, keys, args...)
			} else {
				run = lua.SlidingWindow.EvalSha(ctx, p, keys, args...)
			}
			if repeat {
				p.Set(ctx, keyBase(l.prefix, taskType)+ackKeyWord, "1", ackKeyTTL)
			}
			wait = p.Do(ctx, "WAIT", l.minReplicas, waitMS) // Pipeliner has no Wait
			return nil
		})
		return run, wait
	}
	run, wait := send(false)
	if errors.Is(run.Err(), redis.ErrNoScript) || redis.HasErrorPrefix(run.Err(), "NOSCRIPT") {
		run, wait = send(true)
	}
	if err := run.Err(); err != nil {
		l.reloadOnRedirect(ctx, err)
		return nil, 0, err
	}
	r, err := run.Int64Slice()
	if err != nil {
		return nil, 0, err
	}
	n, err := wait.Int64()
	if err != nil {
		return nil, 0, fmt.Errorf("WAIT: %w", err)
	}
	return r, int(n), nil
}

// nodeFor returns the client to pipeline a durable decision on key with: the master of
// key's slot on a Redis Cluster, otherwise the Limiter's client (a single node, or a
// Sentinel failover client, which talks to the master only).
func (l *Limiter) nodeFor(ctx context.Context, key string) (redis.Cmdable, error) {
	if c, ok := l.rdb.(*redis.ClusterClient); ok {
		m, err := c.MasterForKey(ctx, key)
		if err != nil {
			return nil, fmt.Errorf("master of %s: %w", key, err)
		}
		return m, nil
	}
	return l.rdb, nil
}

// reloadOnRedirect refreshes a cluster client's slot map when the master it sent a durable
// decision to answered MOVED or ASK (the slot moved, or a failover promoted another
// node): the pipeline went to one node, which does not follow redirects, so the next call
// would go there again.
func (l *Limiter) reloadOnRedirect(ctx context.Context, err error) {
	if c, ok := l.rdb.(*redis.ClusterClient); ok && (redis.HasErrorPrefix(err, "MOVED") || redis.HasErrorPrefix(err, "ASK")) {
		c.ReloadState(ctx)
	}
}

// clientReadTimeout is the read timeout of rdb's connections, 0 if it has none or it
// cannot be told.
func clientReadTimeout(rdb redis.UniversalClient) time.Duration {
	switch c := rdb.(type) {
	case *redis.Client:
		return c.Options().ReadTimeout
	case *redis.ClusterClient:
		return c.Options().ReadTimeout
	}
	return 0
}
