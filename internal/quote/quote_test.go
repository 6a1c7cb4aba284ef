package quote_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
)

func TestQuoteNameCut(t *testing.T) {
	t.Parallel()
	x64 := strings.Repeat("x", 64)
	tests := []struct {
		s                string
		quote, name, cut string
	}{
		{"acme", `"acme"`, `acme`, `acme`},
		{"api:call", `"api:call"`, `api:call`, `api:call`},
		{"", `""`, `""`, ``},
		{"two words", `"two words"`, `"two words"`, `two words`},
		{"line\nbreak", `"line\nbreak"`, `"line\nbreak"`, "line\nbreak"},
		{"caf\u00e9 \x00\x1b[31m", `"café \x00\x1b[31m"`, `"café \x00\x1b[31m"`, "caf\u00e9 \x00\x1b[31m"},
		{"bad\xffbyte", `"bad\xffbyte"`, `"bad\xffbyte"`, "bad\xffbyte"},
		{x64, `"` + x64 + `"`, x64, x64},
		{strings.Repeat("x", 65), `"` + x64 + `"...(65 bytes)`, x64 + `...(65 bytes)`, x64 + `...(65 bytes)`},
		{strings.Repeat("x", 1<<20), `"` + x64 + `"...(1048576 bytes)`, x64 + `...(1048576 bytes)`, x64 + `...(1048576 bytes)`},
		// 'a' then 2-byte characters: byte 64 is inside the 32nd é, which is left out.
		{"a" + strings.Repeat("é", 40), `"a` + strings.Repeat("é", 31) + `"...(81 bytes)`,
			`a` + strings.Repeat("é", 31) + `...(81 bytes)`, `a` + strings.Repeat("é", 31) + `...(81 bytes)`},
		// 63 ASCII bytes and a 2-byte character across the limit: cut before it.
		{strings.Repeat("c", 63) + "é" + "tail", `"` + strings.Repeat("c", 63) + `"...(69 bytes)`,
			strings.Repeat("c", 63) + `...(69 bytes)`, strings.Repeat("c", 63) + `...(69 bytes)`},
		// Continuation bytes that start no character: cut 3 bytes back at most.
		{strings.Repeat("c", 60) + strings.Repeat("\x80", 10), `"` + strings.Repeat("c", 60) + `\x80"...(70 bytes)`,
			`"` + strings.Repeat("c", 60) + `\x80"...(70 bytes)`, strings.Repeat("c", 60) + "\x80...(70 bytes)"},
		// A newline past the cut does not reach the line.
		{x64 + "\nINJECTED", `"` + x64 + `"...(73 bytes)`, x64 + `...(73 bytes)`, x64 + `...(73 bytes)`},
	}
	for _, tc := range tests {
		if got := quote.Quote(tc.s); got != tc.quote {
			t.Errorf("Quote(%.30q) = %s, want %s", tc.s, got, tc.quote)
		}
		if got := quote.Name(tc.s); got != tc.name {
			t.Errorf("Name(%.30q) = %s, want %s", tc.s, got, tc.name)
		}
		if got := quote.Cut(tc.s); got != tc.cut {
			t.Errorf("Cut(%.30q) = %q, want %q", tc.s, got, tc.cut)
		}
	}
}

// TestQuoteError: an error's text is quoted whole up to MaxErrorBytes (256), so that its
// cause, which comes last, shows; a longer one is cut there, with its length.
func TestQuoteError(t *testing.T) {
	t.Parallel()
	e := `demo: api:call for tenant "acme": Post "http://127.0.0.1:6399/x": dial tcp 127.0.0.1:6399: connect: connection refused`
	if got, want := quote.QuoteError(e), strconv.Quote(e); got != want {
		t.Errorf("QuoteError(%d bytes) = %s, want %s", len(e), got, want)
	}
	long := strings.Repeat("x", 300)
	if got, want := quote.QuoteError(long), strconv.Quote(long[:256])+"...(300 bytes)"; got != want {
		t.Errorf("QuoteError(300 bytes) = %s, want %s", got, want)
	}
}
