package main

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"testing"
)

// TestRun runs the example as `go run ./examples/tiers` does: it must exit 0, the worker
// must have put the change in force without a restart, and the table must show that no
// tenant ran over its tier in any second, before (2 each) or after (acme 2, bigco 10), and
// that bigco ran more than the free tier ever allows after the change.
func TestRun(t *testing.T) {
	var out bytes.Buffer
	if code := run(context.Background(), &out); code != 0 {
		t.Fatalf("exit %d, want 0; output:\n%s", code, out.String())
	}
	if !regexp.MustCompile(`(?m)^the worker put overrides version 2 in force \d+\.\ds later, without a restart$`).Match(out.Bytes()) {
		t.Errorf("no line saying the worker put the change in force; output:\n%s", out.String())
	}
	row := regexp.MustCompile(`(?m)^  (acme|bigco) +(free|pro) +[\d.]+ +(\d+)/2 +[\d.]+ +(\d+)/(\d+)$`)
	rows := row.FindAllStringSubmatch(out.String(), -1)
	if len(rows) != 2 || rows[0][1] != "acme" || rows[1][1] != "bigco" {
		t.Fatalf("want a row for acme, then bigco; output:\n%s", out.String())
	}
	for _, r := range rows {
		before, _ := strconv.Atoi(r[3])
		after, _ := strconv.Atoi(r[4])
		limit := map[string]string{"acme": "2", "bigco": "10"}[r[1]]
		if before > 2 || r[5] != limit || after > map[string]int{"acme": 2, "bigco": 10}[r[1]] || r[1] == "bigco" && after <= 2 {
			t.Errorf("%s: %q; want at most 2 in any second before, and after at most %s (bigco: more than 2)", r[1], r[0], limit)
		}
	}
}
