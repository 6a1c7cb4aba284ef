package redistest

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// ReportVersion returns a go-redis hook (redis.Client.AddHook) that answers INFO with a
// server section of the given redis_version, without asking the server, and passes every
// other command on: a test's stand-in for a Redis version this machine does not have.
func ReportVersion(version string) redis.Hook { return reportVersion(version) }

// reportVersion is the hook ReportVersion returns: the version it reports.
type reportVersion string

// DialHook dials as the client would.
func (reportVersion) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook answers INFO with a server section of v, and sends every other command on.
func (v reportVersion) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if c, ok := cmd.(*redis.StringCmd); ok && cmd.Name() == "info" {
			c.SetVal("# Server\r\nredis_version:" + string(v) + "\r\nredis_mode:standalone\r\n")
			return nil
		}
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook sends pipelines on unchanged.
func (reportVersion) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
