// Package lua holds the Redis scripts of asynq-throttle, embedded with go:embed, and one
// *redis.Script for each. A Script's Run sends EVALSHA and falls back to EVAL when the
// server answers NOSCRIPT (after a restart or SCRIPT FLUSH), so callers never load
// scripts by hand. Each .lua file documents its KEYS, ARGV and reply in its header.
package lua

import (
	_ "embed"

	"github.com/redis/go-redis/v9"
)

//go:embed sliding_window.lua
var slidingWindowSrc string

// SlidingWindow decides one event against one or more sliding-window logs at once, all or
// nothing: sliding_window.lua documents its KEYS, ARGV and integer reply.
var SlidingWindow = redis.NewScript(slidingWindowSrc)
