package redisenv

import (
	"bytes"
	"context"
	"errors"
	"log"
	"testing"
)

// TestDialFilter: QuietDialLogs's logger drops go-redis's line for a failed dial (one a
// dial while Redis is down) and passes its others, a Sentinel's failover notice among
// them, as go-redis would print them.
func TestDialFilter(t *testing.T) {
	var buf bytes.Buffer
	f := dialFilter{log.New(&buf, "redis: ", 0)}
	f.Printf(context.Background(), "redis: connection pool: failed to dial after %d attempts: %v", 5, errors.New("connection refused"))
	f.Printf(context.Background(), "sentinel: new master=%q addr=%q", "mymaster", "10.0.0.5:6379")
	if got, want := buf.String(), "redis: sentinel: new master=\"mymaster\" addr=\"10.0.0.5:6379\"\n"; got != want {
		t.Errorf("logged %q, want %q", got, want)
	}
}
