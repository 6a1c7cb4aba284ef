// Package quote shows user data (tenants, task types) in log lines and error texts: cut
// to MaxBytes, so that a 1 MB tenant makes a short line, and quoted, so that a newline or
// a terminal escape in one cannot break the line or forge another.
//
// Every command and package of this module shows tenants and task types through it:
// cmd/worker's and cmd/enqueue's summary lines, package worker's log lines, and the
// error texts of packages throttle, producer and worker.
package quote

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

// MaxBytes is the most bytes of a tenant or a task type that a log line or an error text
// shows; a longer one shows its first MaxBytes bytes (fewer, to end at a character
// boundary) followed by "...(N bytes)", N its whole length.
const MaxBytes = 64

// Quote returns s for a line of text: strconv.Quote of s, or, if s is longer than
// MaxBytes, of its first MaxBytes bytes, followed by "...(N bytes)":
//
//	"acme"
//	"line\nbreak"
//	"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"...(10240 bytes)
func Quote(s string) string { return show(s, true) }

// Name is Quote for names that rarely need quotes, such as task types: s is quoted only
// if it is empty, not valid UTF-8, or holds a space, a quote or an unprintable
// character. api:call shows as api:call, "two words" with its quotes.
func Name(s string) string { return show(s, false) }

// Cut returns s for the value of a structured log attribute (log/slog), whose handler
// quotes it as it needs (slog's text handler when it holds spaces, quotes or unprintable
// characters; JSON always): s if it is at most MaxBytes long, else its first MaxBytes
// bytes followed by "...(N bytes)".
func Cut(s string) string {
	if len(s) <= MaxBytes {
		return s
	}
	return s[:cut(s)] + suffix(s)
}

// MaxErrorBytes is the most bytes of an error text that QuoteError shows: an error's
// cause comes last, after its context.
const MaxErrorBytes = 256

// QuoteError is Quote for an error's text, cut to MaxErrorBytes instead of MaxBytes.
func QuoteError(err string) string { return showUpTo(err, true, MaxErrorBytes) }

// show returns s cut to MaxBytes, quoted if quote is set or s needs it (see Name), then
// "...(N bytes)" if s was cut.
func show(s string, quote bool) string { return showUpTo(s, quote, MaxBytes) }

// showUpTo is show with max bytes instead of MaxBytes.
func showUpTo(s string, quote bool, max int) string {
	shown := s
	if len(s) > max {
		shown = s[:cutAt(s, max)]
	}
	if quote || shown == "" || !utf8.ValidString(shown) || strings.ContainsFunc(shown, func(r rune) bool {
		return r == '"' || r == ' ' || !strconv.IsPrint(r)
	}) {
		shown = strconv.Quote(shown)
	}
	if len(s) > max {
		shown += suffix(s)
	}
	return shown
}

// cut is where to cut s, longer than MaxBytes: MaxBytes, moved back to the start of the
// character it falls in (at most utf8.UTFMax-1 bytes back: bytes that are not UTF-8 are
// cut where they are), so that a valid character is never shown as bytes.
func cut(s string) int { return cutAt(s, MaxBytes) }

// cutAt is cut at max bytes instead of MaxBytes (s is longer than max).
func cutAt(s string, max int) int {
	c := max
	for c > max-(utf8.UTFMax-1) && !utf8.RuneStart(s[c]) {
		c--
	}
	return c
}

func suffix(s string) string { return "...(" + strconv.Itoa(len(s)) + " bytes)" }
