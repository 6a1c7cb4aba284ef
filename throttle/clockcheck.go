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

// clockCheckMaxRTT is the longest round trip of a measure that may vouch for the clock:
// the range it leaves (see clockCheck) is the skew's uncertainty, and the middleware
// waits out the range's upper end before a handler starts, so a wide one would hold
// every admitted task's worker slot that much longer. A call slower than this (a busy
// Redis or process, a restart) leaves the script to check each write, as without a
// measure, until a quicker one measures again.
const clockCheckMaxRTT = 5 * time.Millisecond

// clockCheck is a Limiter's latest measure of its clock (Config.NowFunc) against the
// Redis server's TIME, taken from a call whose script read TIME. The skew check reads
// TIME before every write; with a measure younger than ClockCheckInterval the Limiter
// makes that check itself, so most writes need no TIME: one redis.call less, a tenth of
// an admission's Redis instructions (README, Performance).
//
// A measure is a range, not a point. The call was stamped callerMS (its monotonic time
// mono) and its reply came rtt later; the script read TIME, serverMS, somewhere in
// between. So the caller's clock was then ahead of the server's by at least callerMS -
// serverMS (TIME read at once) and at most that plus rtt (TIME read just before the
// reply): a call that waited in Redis, in a pause of this process or across a restart
// only widens the range, never moves it. Since then the process's monotonic clock (which
// no clock step moves) has run elapsed, and the server's clock the same; so the range now
// is the measure's plus (nowMS - callerMS) - elapsed: a step of the local clock (NTP, an
// operator, a test's NowFunc) counts in full at once. The Limiter vouches for its clock
// only from a measure of at most clockCheckMaxRTT and while the whole range is within
// MaxSkew, and gives the range's upper end as the skew: the middleware waits out a
// positive skew before a handler starts, and an estimate too low would start it early. What a measure cannot see is the server's clock
// stepping, or drift within an interval, both bounded by ClockCheckInterval.
//
// It is not used on a Redis Cluster (Limiter.vouch): each master has its own clock, and
// a measure of one does not vouch for another. Behind a Sentinel failover client it is:
// for up to ClockCheckInterval after a failover, the old primary's measure vouches for
// the new one's clock (README, Clocks and skew).
type clockCheck struct {
	last atomic.Pointer[clockMeasure]
}

// clockMeasure is one measure: see clockCheck.
type clockMeasure struct {
	mono     time.Time // time.Now() just before the call was stamped: its monotonic reading
	callerMS int64     // the caller's clock then, ms
	skewMS   int64     // callerMS minus the server's TIME during the call, ms: the range's low end
	rttMS    int64     // from the stamp to the reply, ms rounded up: the range's width
}

// estimate returns how far the caller's clock (nowMS, read between the monotonic readings
// before and after) may be ahead of the server's TIME, in ms (the upper end of the
// range, see clockCheck), and true if a measure younger than ClockCheckInterval, of a
// round trip of at most clockCheckMaxRTT, vouches that the whole range is within
// maxSkewMS; else 0 and false, and the call must check. The two readings bound when
// nowMS was read: a pause between them (a NowFunc that blocks, the goroutine
// descheduled) widens the range instead of moving it. Each end also allows 1 ms for the
// whole-ms instants it is made of.
func (c *clockCheck) estimate(before, after time.Time, nowMS, maxSkewMS int64) (int64, bool) {
	m := c.last.Load()
	if m == nil || m.rttMS > clockCheckMaxRTT.Milliseconds() {
		return 0, false
	}
	least, most := before.Sub(m.mono), after.Sub(m.mono) // the time since the measure's stamp
	if least < 0 || most >= ClockCheckInterval {
		return 0, false
	}
	ahead := m.skewMS + (nowMS - m.callerMS) // of the server's clock at the measure
	low := ahead - (most + time.Millisecond - 1).Milliseconds() - 1
	high := ahead - least.Milliseconds() + m.rttMS + 1
	if low < -maxSkewMS || high > maxSkewMS {
		return 0, false
	}
	return high, true
}

// record keeps the measure of a call stamped nowMS, after the monotonic reading mono,
// whose script read the server's TIME, serverMS, and whose reply came rtt after mono. A measure whose
// range is not within MaxSkew (the call fell back to TIME, or waited long) is kept all
// the same: estimate then refuses to vouch until a later measure is within it.
func (c *clockCheck) record(mono time.Time, nowMS, serverMS int64, rtt time.Duration) {
	c.last.Store(&clockMeasure{mono: mono, callerMS: nowMS, skewMS: nowMS - serverMS,
		rttMS: (rtt + time.Millisecond - 1).Milliseconds()})
}
