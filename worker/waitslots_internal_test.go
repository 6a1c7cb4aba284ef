package worker

import "testing"

// TestWaitSlots_scarce: the waiting slots are scarce from two taken and half of them on:
// for Concurrency 10 (9 slots) at 5 taken, for Concurrency 3 (2 slots) at 2, and never
// for Concurrency 1 or 2 (one slot), nor without a bound.
func TestWaitSlots_scarce(t *testing.T) {
	for _, c := range []struct {
		concurrency int
		scarceFrom  int // taken slots; 0: never
	}{{10, 5}, {5, 2}, {3, 2}, {2, 0}, {1, 0}, {0, 0}} {
		s := newWaitSlots(c.concurrency)
		for taken := 1; taken <= max(cap(s), 3); taken++ {
			if !s.take() {
				break
			}
			want := c.scarceFrom > 0 && taken >= c.scarceFrom
			if got := s.scarce(); got != want {
				t.Errorf("Concurrency %d, %d slots taken: scarce %v, want %v", c.concurrency, taken, got, want)
			}
		}
	}
}
