package throttle

import (
	"strings"
	"testing"
	"time"
)

// TestAppendExtra: the script's extra argument is written byte for byte as the format it
// replaced did, fmt.Sprintf("%d:%d:%d:%d:%d:%d:%s%d:%s%s", ...) after "p<priority>:" for a
// priority above 0, spelled out here for each case: longer than the 128-byte buffer
// decide starts it in, with an escaped tenant, and with zeros.
func TestAppendExtra(t *testing.T) {
	long := strings.Repeat("h", 150)
	for _, c := range []struct {
		req          Request
		cost, weight int
		claimTimeout time.Duration
		want         string
	}{
		{
			req:  Request{Key: Key{TaskType: "api:call", Tenant: "acme"}, Reservation: "task-1", Holder: "7:default" + "task-1", MaxWait: 250 * time.Millisecond, ClaimWait: 2 * time.Second},
			cost: 1, weight: 1, claimTimeout: 5250 * time.Millisecond,
			want: "1:250:5250:2000:1:6:task-115:7:defaulttask-1acme",
		},
		{
			req:  Request{Key: Key{TaskType: "api:call", Tenant: "a b/{é}"}, Priority: 1000},
			cost: 3, weight: 1_000_000, claimTimeout: DefaultClaimTimeout,
			want: "p1000:3:0:5000:0:1000000:0:0:a%20b%2F%7B%C3%A9%7D",
		},
		{
			req:  Request{Key: Key{TaskType: "t"}, Reservation: "r", Holder: long, MaxWait: 1500 * time.Microsecond},
			cost: 2, weight: 7, claimTimeout: time.Millisecond,
			want: "2:1:1:0:7:1:r150:" + long,
		},
	} {
		if got := string(appendExtra(nil, &c.req, c.cost, c.weight, c.claimTimeout)); got != c.want {
			t.Errorf("appendExtra(%+v, cost %d, weight %d, claim timeout %s) =\n%q, want\n%q", c.req, c.cost, c.weight, c.claimTimeout, got, c.want)
		}
	}
}
