package agent

import (
	"fmt"

	"github.com/rlagent/rlagent/maps"
	"github.com/rlagent/rlagent/watcher"
)

// Share is a limit's part at this node.
type Share struct {
	Rate  uint64 // units/s
	Burst uint64
	// Divisor is the count the limit was divided by, after clamping: at
	// least 1 for the divided scopes.
	Divisor int
	// Local is, for the service scope, the replicas on this node.
	Local int
	// Warning says why this share is not what the operator may expect
	// (a count below 1, a share below 1 unit/s), or "".
	Warning string
}

// divide is the Divide step of Watch -> Divide -> Enforce.
//
//   - static, file, nodes: rate / replicas; a count below 1 is treated as 1.
//   - service: rate x local / replicas, node-weighted, so uneven placement
//     of endpoints is exact; no local endpoint gives a share of 0.
//
// The burst is divided the same way, with a floor of 1. A share below one
// unit per second is raised to 1 (the data path counts whole units), which
// lets the nodes together admit more than the global rate: that case is
// reported in Warning.
func divide(rate, burst uint64, service bool, o watcher.Observation) Share {
	if service {
		if o.Local <= 0 || o.Replicas <= 0 {
			return Share{Divisor: max(o.Replicas, 0)}
		}
		local, total := uint64(min(o.Local, o.Replicas)), uint64(o.Replicas)
		s := Share{Rate: rate * local / total, Burst: max(burst*local/total, 1), Divisor: o.Replicas, Local: o.Local}
		if s.Rate == 0 {
			s.Rate = 1
			s.Warning = "node share below 1 unit/s raised to 1: the nodes together may admit more than the global rate"
		}
		return s
	}
	s := Share{Divisor: o.Replicas}
	if s.Divisor < 1 {
		s.Divisor = 1
		s.Warning = "replica count below 1 treated as 1"
	}
	n := uint64(s.Divisor)
	s.Rate = rate / n
	s.Burst = max(burst/n, 1)
	if s.Rate == 0 {
		s.Rate = 1
		s.Warning = "node share below 1 unit/s raised to 1: the nodes together may admit more than the global rate"
	}
	return s
}

// fit keeps a share within the data path's range: a rate above
// maps.MaxRate is lowered to it (and the burst with it, by toMapsLimit), and
// note says so; otherwise note is "".
//
// Validation bounds the global rate by the same maximum (the count can fall
// to 1), so only a spec that skipped validation gets here; a clamped share
// is still enforced, never refused: refusing it would leave the traffic
// unlimited, and a share too large for the data path is a share that does
// not limit much anyway.
func (s Share) fit() (_ Share, note string) {
	if s.Rate <= maps.MaxRate {
		return s, ""
	}
	note = fmt.Sprintf("node share %d units/s is above the data path's maximum of %d per node: clamped to %d", s.Rate, maps.MaxRate, maps.MaxRate)
	s.Rate = maps.MaxRate
	s.Burst = min(s.Burst, maps.MaxBurstSeconds*maps.MaxRate)
	return s, note
}
