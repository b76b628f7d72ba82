package limiter

import "time"

// A Clock is the limiter's time. The zero Options use the real one; tests
// set their own, so that the buckets' arithmetic is tested without
// sleeping.
type Clock interface {
	// Now is a monotonic time in nanoseconds, from any origin.
	Now() int64
	// After sends on the channel once d has passed, as time.After.
	After(d time.Duration) <-chan time.Time
}

// realClock is time's monotonic clock, counted from the limiter's start.
type realClock struct{ base time.Time }

func (c realClock) Now() int64                           { return int64(time.Since(c.base)) }
func (realClock) After(d time.Duration) <-chan time.Time { return time.After(d) }
