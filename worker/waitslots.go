package worker

// waitSlots bounds the handlers that sit out a wait for a slot ahead in the middleware
// (Config.Concurrency - 1 of them, one for a server of one worker), so that at least one worker slot of the asynq server
// is always left to tasks that can run now: unruled tasks, and ruled ones due now. A nil
// waitSlots (Concurrency 0) bounds nothing.
//
// A task takes a waiting slot, if one is free, before it asks the limiter: only then may
// the limiter admit it for a slot ahead (throttle.Request.MaxWait, ClaimWait). Without
// one it asks for now only: it is admitted if it can start at once, and otherwise denied,
// keeping its reservation if it came back for one (the script denies a claim ahead of
// ClaimWait writing nothing), and re-queued for it. So the limiter never logs an
// admission for an instant ahead that the task then cannot wait for: its slot is never
// lost, and the window log stays exact.
type waitSlots chan struct{}

// newWaitSlots returns the waiting slots of an asynq server of concurrency workers: one
// less than them, or nil, no bound, for concurrency <= 0. One worker alone gets one
// waiting slot: with none, a reservation could only be claimed by a task that came back
// on its very millisecond, which asynq's re-queues (in whole seconds) never do, so the
// reserved tasks would be decided afresh behind the next ones for ever and none would
// run. There the slot left to other tasks cannot exist: they wait behind a throttled one
// for at most MaxWait.
func newWaitSlots(concurrency int) waitSlots {
	if concurrency <= 0 {
		return nil
	}
	return make(waitSlots, max(concurrency-1, 1))
}

// take takes a waiting slot if one is free, without blocking, and reports whether it did
// (always true without a bound). Each take that returned true is followed by one give.
func (s waitSlots) take() bool {
	if s == nil {
		return true
	}
	select {
	case s <- struct{}{}:
		return true
	default:
		return false
	}
}

// give gives back a slot that take took.
func (s waitSlots) give() {
	if s != nil {
		<-s
	}
}

// scarce reports whether two waiting slots or more, and half of them or more, are taken
// (none are scarce without a bound): then a task due later than Config.Concurrency's
// scarceClaimWait leaves its slot to one due sooner. A task alone in the slots (it counts
// its own) is never short of one: with Concurrency 1 to 3, one slot is half of them.
func (s waitSlots) scarce() bool {
	n := len(s)
	return s != nil && n >= 2 && 2*n >= cap(s)
}
