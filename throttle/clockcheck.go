package throttle

import (
	"sync/atomic"
	"time"
)

// ClockCheckInterval is how long one measure of the local clock against the Redis server's
// TIME vouches for it. Within it, Allow (ClockLocal, MaxSkew > 0) asks the script to trust
// the caller's clock without reading TIME, its skew tracked from that measure (see
// clockCheck); the first call after it that writes measures again. Clocks drift by parts
// per million, so a second-old measure is as good as a new one; a clock that steps is
// seen at once.
const ClockCheckInterval = time.Second

// clockCheck is a Limiter's latest measure of its clock (Config.NowFunc) against the
// Redis server's TIME, taken from a call whose script read TIME. The skew check reads
// TIME before every write; with a measure younger than ClockCheckInterval the Limiter
// makes that check itself, so most writes need no TIME: one redis.call less, a fifth of
// an admission's Redis instructions (README, Performance).
//
// The estimate: at the measure the caller's clock read callerMS and was skewMS ahead of
// TIME; since then the process's monotonic clock (time.Now's, which no clock step moves)
// has run elapsed, and the server's clock has run the same. So the caller's clock is now
// skewMS + (nowMS - callerMS) - elapsed ahead: a step of the local clock (NTP, an
// operator, a test's NowFunc) counts in full at once. What it cannot see is the server's
// clock stepping, or drift within an interval, both bounded by ClockCheckInterval.
//
// It is not used on a Redis Cluster (Limiter.vouch): each master has its own clock, and
// a measure of one does not vouch for another.
type clockCheck struct {
	last atomic.Pointer[clockMeasure]
}

// clockMeasure is one measure: see clockCheck.
type clockMeasure struct {
	mono     time.Time // time.Now() when the call was stamped: its monotonic reading
	callerMS int64     // the caller's clock then, ms
	skewMS   int64     // callerMS minus the server's TIME during the call, ms
}

// estimate returns how far the caller's clock (nowMS, read with mono) is ahead of the
// server's TIME, in ms, and true if a measure younger than ClockCheckInterval vouches
// that it is within maxSkewMS; else 0 and false, and the call must check.
func (c *clockCheck) estimate(mono time.Time, nowMS, maxSkewMS int64) (int64, bool) {
	m := c.last.Load()
	if m == nil {
		return 0, false
	}
	elapsed := mono.Sub(m.mono)
	if elapsed < 0 || elapsed >= ClockCheckInterval {
		return 0, false
	}
	skew := m.skewMS + (nowMS - m.callerMS) - elapsed.Milliseconds()
	if skew > maxSkewMS || skew < -maxSkewMS {
		return 0, false
	}
	return skew, true
}

// record keeps the measure of a call stamped nowMS (with mono) whose script read the
// server's TIME, serverMS; a measure whose skew is over maxSkewMS (the call fell back to
// TIME) is kept all the same, so estimate refuses to vouch until a later measure is
// within it.
func (c *clockCheck) record(mono time.Time, nowMS, serverMS int64) {
	c.last.Store(&clockMeasure{mono: mono, callerMS: nowMS, skewMS: nowMS - serverMS})
}
