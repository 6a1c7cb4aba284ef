package main

import (
	"bytes"
	"testing"
	"time"
)

func TestLines_update(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	l := &lines{w: &buf}
	l.update(0, 30, 0, 0, 0)
	l.update(3, 30, 9, 0, 500*time.Millisecond) // under a second since the last line
	l.update(9, 30, 21, 1, 1000*time.Millisecond)
	l.update(30, 30, 36, 1, 1200*time.Millisecond) // done: always said
	want := "demo:   0.0s  0/30 tasks completed, throttled 0, API 429s 0\n" +
		"demo:   1.0s  9/30 tasks completed, throttled 21, API 429s 1\n" +
		"demo:   1.2s  30/30 tasks completed, throttled 36, API 429s 1\n"
	if buf.String() != want {
		t.Errorf("got\n%s\nwant\n%s", buf.String(), want)
	}
}
