package limiter

import (
	"context"
	"time"
)

// OnEmpty is what a draw against an empty bucket does: the limit's policy.
type OnEmpty string

const (
	// OnEmptyFail fails the draw at once.
	OnEmptyFail OnEmpty = "fail"
	// OnEmptyWait waits until the draw's tokens accrue, up to the limit's
	// MaxWait; a draw that cannot be served within MaxWait fails at once.
	OnEmptyWait OnEmpty = "wait"
)

// LimitConfig is one limit as this replica enforces it: its share of the
// global limit, and its policy.
type LimitConfig struct {
	// Name identifies the limit in Sets, errors, metrics and headers.
	Name string
	// Rate is this replica's share of the global rate, in requests per
	// second. More than 0.
	Rate float64
	// Burst is this replica's share of the global burst: the requests
	// that may go at once. At least 1.
	Burst int64
	// Keyed gives every key its own bucket (each with the whole Rate and
	// Burst); else the limit is one bucket.
	Keyed bool
	// OnEmpty is the limit's policy; "" is OnEmptyFail.
	OnEmpty OnEmpty
	// MaxWait is, with OnEmptyWait, the longest a draw waits: one that
	// would wait longer fails at once, drawing nothing.
	MaxWait time.Duration
	// Shadow admits a draw that would fail, and counts it as failed: a
	// limit on trial.
	Shadow bool

	// What the share was divided from, for metrics and logs.

	// GlobalRate and GlobalBurst are the limit's global values.
	GlobalRate  uint64
	GlobalBurst uint64
	// Replicas is the count the global values were divided by.
	Replicas int
}

// A Source tells a Limiter its limits and their shares at this replica.
type Source interface {
	// Run calls apply with every limit's config, the whole set each time,
	// whenever one changes, until ctx ends. It never calls apply
	// concurrently.
	Run(ctx context.Context, apply func([]LimitConfig)) error
}

// A CountAger is a Source that knows how old each limit's count is: the
// time since the count was last confirmed (0 for a count that never ages,
// such as a static one). The Limiter's metrics report it.
type CountAger interface {
	CountAge(limit string) time.Duration
}
