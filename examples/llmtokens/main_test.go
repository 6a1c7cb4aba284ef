package main

import (
	"bytes"
	"context"
	"regexp"
	"testing"
)

// TestRun runs the example as `go run ./examples/llmtokens` does: it must exit 0, and its
// journal must show acme's 429 pausing acme, acme's second call paused, globex's third
// held back by the tokens per minute (8000 of 10000 used), both acme calls run after the
// pause with no retry spent, and no acme call reaching the API during the pause.
func TestRun(t *testing.T) {
	var out bytes.Buffer
	if code := run(context.Background(), &out); code != 0 {
		t.Fatalf("exit %d, want 0; output:\n%s", code, out.String())
	}
	for _, line := range []string{
		`(?m)^  \+[\d.]+s  acme call 1 +the API answered 429 Too Many Requests, Retry-After: 2: acme paused on every worker$`,
		`(?m)^  \+[\d.]+s  acme call 2 +paused until \+[\d.]+s: re-queued for then$`,
		// globex's calls reach the limiter in whatever order asynq hands them out: the third
		// to get there waits (counted below: two of them run).
		`(?m)^  \+[\d.]+s  globex call [123] +over tenant=10000/1m \(8000 of 10000 tokens used\): waits [\dms.]+ for its slot$`,
		`(?m)^  \+[\d.]+s  acme call 1 +3000 tokens, ok \(retries spent: 0\)$`,
		`(?m)^  \+[\d.]+s  acme call 2 +3000 tokens, ok \(retries spent: 0\)$`,
		`(?m)^acme was paused until \+[\d.]+s, and the API got 0 calls for acme meanwhile; `,
	} {
		if !regexp.MustCompile(line).Match(out.Bytes()) {
			t.Errorf("no line matching %s; output:\n%s", line, out.String())
		}
	}
	if n := len(regexp.MustCompile(`(?m)^  \+[\d.]+s  globex call [123] +4000 tokens, ok \(retries spent: 0\)$`).FindAll(out.Bytes(), -1)); n != 2 {
		t.Errorf("%d of globex's calls ran, want 2; output:\n%s", n, out.String())
	}
	if n := len(regexp.MustCompile(`(?m) ok \(retries spent`).FindAll(out.Bytes(), -1)); n != 4 {
		t.Errorf("%d calls ran, want 4 (globex's third waits for the minute); output:\n%s", n, out.String())
	}
}
