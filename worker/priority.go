package worker

import (
	"context"
	"fmt"
	"slices"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// QueuePriorities returns, for an asynq.Config.Queues map (queue name -> weight), the
// priority Config.QueuePriority gives each queue's tasks: its weight's rank among the
// distinct weights, 0 for the lowest, 1 for the next, and so on (capped at
// throttle.MaxPriority). So {"critical": 6, "default": 3, "low": 1} gives critical 2,
// default 1 and low 0: a task from a queue of higher weight, denied, takes the earliest
// slot that a reservation from a queue of lower weight holds (throttle.Request.Priority),
// whether asynq serves the queues by weight or with StrictPriority. The lowest queue's
// tasks, of priority 0, keep the limiter's shortest script paths.
func QueuePriorities(queues map[string]int) map[string]int {
	var weights []int
	for _, w := range queues {
		weights = append(weights, w)
	}
	slices.Sort(weights)
	weights = slices.Compact(weights)
	out := make(map[string]int, len(queues))
	for q, w := range queues {
		rank, _ := slices.BinarySearch(weights, w)
		out[q] = min(rank, throttle.MaxPriority)
	}
	return out
}

// checkQueuePriority returns an error unless every priority is in [0, throttle.MaxPriority].
func checkQueuePriority(p map[string]int) error {
	for q, n := range p {
		if n < 0 || n > throttle.MaxPriority {
			return fmt.Errorf("worker: QueuePriority[%q] = %d, outside [0, %d]", q, n, throttle.MaxPriority)
		}
	}
	return nil
}

// priorityOf is the priority of the task whose handler got ctx: its queue's in
// Config.QueuePriority, else 0.
func (m *middleware) priorityOf(ctx context.Context) int {
	if len(m.priority) == 0 {
		return 0
	}
	queue, _ := asynq.GetQueueName(ctx)
	return m.priority[queue]
}
