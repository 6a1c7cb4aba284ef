package main

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"testing"
)

// TestRun runs the example as `go run ./examples/outboundapi` does: it must exit 0, the
// throttled run must get exactly no 429 and complete every task, and the unthrottled run,
// the same workload, must have got 429s.
func TestRun(t *testing.T) {
	var out bytes.Buffer
	if code := run(context.Background(), &out); code != 0 {
		t.Fatalf("exit %d, want 0; output:\n%s", code, out.String())
	}
	line := regexp.MustCompile(`(?m)^(without|with) the throttle: +(\d+)/60 tasks completed in [\d.]+s; the API answered 429 (\d+) times: acme (\d+) globex (\d+) initech (\d+)$`)
	runs := line.FindAllStringSubmatch(out.String(), -1)
	if len(runs) != 2 || runs[0][1] != "without" || runs[1][1] != "with" {
		t.Fatalf("want a line for the run without the throttle, then one with it; output:\n%s", out.String())
	}
	without, with := runs[0], runs[1]
	if with[2] != "60" || with[3] != "0" || with[4] != "0" || with[5] != "0" || with[6] != "0" {
		t.Errorf("with the throttle: %q, want 60/60 completed and no 429 for any tenant", with[0])
	}
	n429, _ := strconv.Atoi(without[3])
	if without[2] != "60" || n429 == 0 {
		t.Errorf("without the throttle: %q, want 60/60 completed after some 429s", without[0])
	}
}
