package main

import (
	"fmt"
	"io"
	"time"

	"github.com/schollz/progressbar/v3"
)

// bar is a progress bar on a terminal. When the run ends it gives way to one status line.
type bar struct {
	w    io.Writer
	pb   *progressbar.ProgressBar
	last string
}

func newBar(w io.Writer) *bar {
	return &bar{w: w, pb: progressbar.NewOptions(1,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription("tasks completed"),
		progressbar.OptionShowCount(),
		progressbar.OptionSetWidth(30),
		progressbar.OptionSetPredictTime(false),
		progressbar.OptionThrottle(100*time.Millisecond),
	)}
}

func (b *bar) update(done, total, throttled, rejected int, elapsed time.Duration) {
	if b.pb.GetMax() != total {
		b.pb.ChangeMax(total)
	}
	b.pb.Describe(fmt.Sprintf("%4.1fs  throttled %d  API 429s %d  completed", elapsed.Seconds(), throttled, rejected))
	_ = b.pb.Set(done)
	b.last = statusLine(done, total, throttled, rejected, elapsed)
}

func (b *bar) finish() {
	_ = b.pb.Exit()
	_ = b.pb.Clear()
	fmt.Fprint(b.w, b.last)
}

// statusLine says how far the run is, as one line.
func statusLine(done, total, throttled, rejected int, elapsed time.Duration) string {
	return fmt.Sprintf("demo: %5.1fs  %d/%d tasks completed, throttled %d, API 429s %d\n",
		elapsed.Seconds(), done, total, throttled, rejected)
}

// lines writes one status line per second where a bar would not render (a pipe, a file).
type lines struct {
	w    io.Writer
	last time.Duration
	said bool
}

func (l *lines) update(done, total, throttled, rejected int, elapsed time.Duration) {
	if l.said && elapsed-l.last < time.Second && done < total {
		return
	}
	l.said, l.last = true, elapsed
	fmt.Fprint(l.w, statusLine(done, total, throttled, rejected, elapsed))
}

func (l *lines) finish() {}
