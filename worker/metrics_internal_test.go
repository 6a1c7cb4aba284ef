package worker

import (
	"strings"
	"testing"
)

func TestTenantLabelValue(t *testing.T) {
	t.Parallel()
	tests := []struct{ tenant, want string }{
		{"", ""},
		{"acme", "acme"},
		{strings.Repeat("x", MaxTenantLabelBytes), strings.Repeat("x", MaxTenantLabelBytes)},
		{strings.Repeat("x", 10_000), strings.Repeat("x", MaxTenantLabelBytes)},
		// 'a' then 2-byte characters: byte 64 is in the middle of the 32nd é, which is dropped.
		{"a" + strings.Repeat("é", 100), "a" + strings.Repeat("é", 31)},
		{"bad\xff\xfeutf8", "bad\uFFFDutf8"}, // a run of bad bytes is one U+FFFD
		{"line\nbreak", "line\nbreak"},       // valid UTF-8 is kept: the exposition format escapes it
	}
	for _, tc := range tests {
		if got := tenantLabelValue(tc.tenant); got != tc.want {
			t.Errorf("tenantLabelValue(%.20q) = %.20q (%d bytes), want %.20q (%d bytes)", tc.tenant, got, len(got), tc.want, len(tc.want))
		}
	}
}
