package count

import (
	"context"
	"time"
)

// Observation is what a source last saw for one limit.
type Observation struct {
	// Replicas is the number of replicas that share the limit (ready agents,
	// ready endpoints, or the static count). 0 means none seen yet.
	Replicas int
	// Local is, for the service scope, how many of those replicas are on
	// this node. Sources without a notion of locality report Replicas.
	Local int
	// At is when the source last confirmed Replicas. Zero if never.
	At time.Time
	// Err is the last error reading the source, nil once a read works again.
	Err error
}

// Age is how old the observation is at now. Zero for a source that cannot
// go stale (At is zero and there is no error).
func (o Observation) Age(now time.Time) time.Duration {
	if o.At.IsZero() {
		return 0
	}
	return now.Sub(o.At)
}

// Source reports replica counts.
type Source interface {
	// Run watches the source until ctx ends, calling notify (never
	// concurrently) after every change of any observation.
	Run(ctx context.Context, notify func())
	// Observe returns the latest observation for the named limit.
	Observe(limit string) Observation
}
