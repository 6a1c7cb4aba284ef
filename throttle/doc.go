// Package throttle is a distributed sliding-window-log rate limiter on Redis. Each window
// log is a sorted set that holds the events admitted in the last window, scored by their
// admission time; one Lua script (package lua) trims, counts and admits an event into
// every log that applies to it, or into none, and says when to retry.
//
// Logs are keyed by business context: the task type and, for per-tenant quotas, the
// tenant. Every log of one task type shares one Redis Cluster hash tag, so one decision is
// one atomic script call on a single node or a cluster alike.
//
// Durations are time.Duration throughout; milliseconds exist only between Go and Lua.
// A Limiter is safe for concurrent use by multiple goroutines. Package throttle does not
// import asynq: package worker adapts it to asynq.
package throttle
