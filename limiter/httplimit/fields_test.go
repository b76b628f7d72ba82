package httplimit

import (
	"net/http"
	"testing"
	"time"

	"github.com/rlagent/rlagent/limiter"
)

// TestFieldsGolden: the fields for fixed states, exact strings, and valid
// per the draft.
func TestFieldsGolden(t *testing.T) {
	for _, tc := range []struct {
		name        string
		sts         []limiter.Status
		policy, cur string // "" when the fields are absent
	}{
		{
			name: "one limit, tokens missing",
			// Rate 1/s, burst 10: w = 10 s, q = 10. 7 left; full in
			// 3 s, so the next token in 1 s.
			sts:    []limiter.Status{{Limit: "per-client", Quota: 10, Window: 10 * time.Second, Remaining: 7, Reset: 3 * time.Second, Rate: 1}},
			policy: `"per-client";q=10;w=10`,
			cur:    `"per-client";r=7;t=1`,
		},
		{
			name: "full bucket has no t",
			sts:  []limiter.Status{{Limit: "api", Quota: 5, Window: 5 * time.Second, Remaining: 5, Rate: 1}},
			// Full: no quota on its way, t is left out.
			policy: `"api";q=5;w=5`,
			cur:    `"api";r=5`,
		},
		{
			name: "sub-second window",
			// Rate 1000/s, burst 100: the window is 100 ms, w is 1 s,
			// and q what 1 s admits at the rate.
			sts:    []limiter.Status{{Limit: "global", Quota: 100, Window: 100 * time.Millisecond, Remaining: 0, Reset: 100 * time.Millisecond, Rate: 1000}},
			policy: `"global";q=1000;w=1`,
			cur:    `"global";r=0;t=1`,
		},
		{
			name: "window rounded up",
			// Rate 3/s, burst 10: 3.33 s, w = 4, q = max(10, 12).
			// Empty, full in 3.4 s: the next token in 3.4 - 9/3 = 0.4 s.
			sts:    []limiter.Status{{Limit: "w", Quota: 10, Window: 3333333333, Remaining: 0, Reset: 3400 * time.Millisecond, Rate: 3}},
			policy: `"w";q=12;w=4`,
			cur:    `"w";r=0;t=1`,
		},
		{
			name: "slow limit, next token far",
			// Rate 0.1/s, burst 10: w = 100. 3 left, full in 65 s:
			// the next token in 65 - 6×10 = 5 s.
			sts:    []limiter.Status{{Limit: "slow", Quota: 10, Window: 100 * time.Second, Remaining: 3, Reset: 65 * time.Second, Rate: 0.1}},
			policy: `"slow";q=10;w=100`,
			cur:    `"slow";r=3;t=5`,
		},
		{
			name: "two limits, one not configured",
			sts: []limiter.Status{
				{Limit: "per-client", Quota: 10, Window: 10 * time.Second, Remaining: 9, Reset: 1 * time.Second, Rate: 1},
				{Limit: "unknown"}, // no quota: not configured yet
				{Limit: "global", Quota: 2000, Window: time.Second, Remaining: 1500, Reset: 250 * time.Millisecond, Rate: 2000},
			},
			policy: `"per-client";q=10;w=10, "global";q=2000;w=1`,
			cur:    `"per-client";r=9;t=1, "global";r=1500;t=1`,
		},
		{
			name: "names escaped",
			sts:  []limiter.Status{{Limit: "we\"ird\\é", Quota: 1, Window: time.Second, Remaining: 1, Rate: 1}},
			// " and \ escaped; é (two bytes of UTF-8) is not printable
			// ASCII: '?' each.
			policy: `"we\"ird\\??";q=1;w=1`,
			cur:    `"we\"ird\\??";r=1`,
		},
		{
			name:   "huge values clamped to 15 digits",
			sts:    []limiter.Status{{Limit: "big", Quota: 1 << 62, Window: time.Duration(1 << 62), Remaining: 1 << 62, Rate: 1e-3}},
			policy: `"big";q=999999999999999;w=4611686019`, // a Duration has no more
			cur:    `"big";r=999999999999999`,
		},
		{
			name: "nothing configured",
			sts:  []limiter.Status{{Limit: "unknown"}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := http.Header{}
			setFields(h, tc.sts)
			if got := h.Get(FieldRateLimitPolicy); got != tc.policy {
				t.Errorf("RateLimit-Policy = %s, want %s", got, tc.policy)
			}
			if got := h.Get(FieldRateLimit); got != tc.cur {
				t.Errorf("RateLimit = %s, want %s", got, tc.cur)
			}
			if tc.policy == "" {
				return
			}
			if _, _, err := checkFields(h.Get(FieldRateLimitPolicy), h.Get(FieldRateLimit)); err != nil {
				t.Error(err)
			}
		})
	}
}

// TestSFParserRejects: the test's parser is not a rubber stamp.
func TestSFParserRejects(t *testing.T) {
	for _, tc := range []struct{ policy, cur string }{
		{`api;q=1;w=1`, `"api";r=1`},              // a Token, the draft wants a String
		{`"api";q=1.5;w=1`, `"api";r=1`},          // a Decimal quota
		{`"api";w=1`, `"api";r=1`},                // no q
		{`"api";q=1;w=0`, `"api";r=1`},            // w not positive
		{`"api";q=1;w=1`, `"other";r=1`},          // names no policy
		{`"api";q=1;w=1`, `"api";t=1`},            // no r
		{`"api";q=1;w=1,`, `"api";r=1`},           // trailing comma
		{`"api";Q=1;w=1`, `"api";r=1`},            // uppercase key
		{`"a"pi";q=1;w=1`, `"a"pi";r=1`},          // unescaped quote
		{`"api";q=1234567890123456`, `"api";r=1`}, // 16 digits
		{`"api";q=1;q=2`, `"api";r=1`},            // a parameter twice
	} {
		if _, _, err := checkFields(tc.policy, tc.cur); err == nil {
			t.Errorf("checkFields(%s, %s): no error", tc.policy, tc.cur)
		}
	}
}

func TestRetryAfter(t *testing.T) {
	full := limiter.Status{Limit: "a", Quota: 10, Window: 10 * time.Second, Remaining: 10, Rate: 1}
	empty := limiter.Status{Limit: "b", Quota: 10, Window: 100 * time.Second, Remaining: 0, Reset: 100 * time.Second, Rate: 0.1}
	some := limiter.Status{Limit: "c", Quota: 10, Window: 100 * time.Second, Remaining: 3, Reset: 65 * time.Second, Rate: 0.1}
	for _, tc := range []struct {
		name   string
		retry  time.Duration
		sts    []limiter.Status
		fields bool
		want   int64
	}{
		{name: "rounded up", retry: 1100 * time.Millisecond, sts: []limiter.Status{full}, fields: true, want: 2},
		{name: "at least 1", retry: 10 * time.Millisecond, fields: true, want: 1},
		{name: "unknown is 1", retry: 0, want: 1},
		// b is empty, its next token in 10 s: a retry before would fail.
		{name: "no earlier than an empty limit's t", retry: time.Second, sts: []limiter.Status{full, empty}, fields: true, want: 10},
		{name: "without fields, the refusal's", retry: time.Second, sts: []limiter.Status{empty}, fields: false, want: 1},
		// c has quota left: its t (5 s) does not hold the retry.
		{name: "a limit with quota left does not count", retry: time.Second, sts: []limiter.Status{some}, fields: true, want: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := retryAfter(&limiter.RejectedError{Limit: "a", RetryAfter: tc.retry}, tc.sts, tc.fields)
			if got != tc.want {
				t.Fatalf("retryAfter = %d, want %d", got, tc.want)
			}
		})
	}
}
