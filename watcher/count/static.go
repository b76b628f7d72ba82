package count

import "context"

// Static is a fixed replica count for every limit.
type Static struct{ n int }

// NewStatic returns a source that always reports n replicas.
func NewStatic(n int) *Static { return &Static{n: n} }

// Run returns when ctx ends: a static count never changes.
func (s *Static) Run(ctx context.Context, _ func()) { <-ctx.Done() }

// Observe reports n, with no time: a static count never ages (Age is 0).
func (s *Static) Observe(string) Observation {
	return Observation{Replicas: s.n, Local: s.n}
}
