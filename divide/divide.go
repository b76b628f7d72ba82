package divide

// Share is a limit's part at one replica (a node, or a process).
type Share struct {
	Rate  uint64 // units/s
	Burst uint64
	// Divisor is the count the limit was divided by, after clamping: at
	// least 1 for Evenly.
	Divisor int
	// Local is, for ByEndpoints, the endpoints at this replica.
	Local int
	// Warning says why this share is not what the operator may expect
	// (a count below 1, a share below 1 unit/s), or "".
	Warning string
}

// belowOne is the Warning of a share raised to 1 unit/s.
const belowOne = "node share below 1 unit/s raised to 1: the nodes together may admit more than the global rate"

// Evenly divides a limit by a count of replicas: rate / replicas, and the
// burst the same way with a floor of 1. A count below 1 is treated as 1.
// A share below one unit per second is raised to 1 (the data path counts
// whole units), which lets the replicas together admit more than the
// global rate: Warning says so.
func Evenly(rate, burst uint64, replicas int) Share {
	s := Share{Divisor: replicas}
	if s.Divisor < 1 {
		s.Divisor = 1
		s.Warning = "replica count below 1 treated as 1"
	}
	n := uint64(s.Divisor)
	s.Rate = rate / n
	s.Burst = max(burst/n, 1)
	if s.Rate == 0 {
		s.Rate = 1
		s.Warning = belowOne
	}
	return s
}

// ByEndpoints divides a limit by where its endpoints are: rate x local /
// replicas, so an uneven placement of the endpoints is exact (a node with
// two of six endpoints gets a third). The burst is divided the same way
// with a floor of 1. No local endpoint (or none at all) gives a share of 0;
// a share below one unit per second is raised to 1, as in Evenly.
func ByEndpoints(rate, burst uint64, local, replicas int) Share {
	if local <= 0 || replicas <= 0 {
		return Share{Divisor: max(replicas, 0)}
	}
	l, total := uint64(min(local, replicas)), uint64(replicas)
	s := Share{Rate: rate * l / total, Burst: max(burst*l/total, 1), Divisor: replicas, Local: local}
	if s.Rate == 0 {
		s.Rate = 1
		s.Warning = belowOne
	}
	return s
}

// ByDemand is the share of a limit whose replica was allocated nodeRate of
// its global rate (share: demand): that rate (at least 1), and the burst
// scaled with it, nodeRate x burst / rate (at least 1). Divisor and Local
// are s's: the count the allocation was made against.
func ByDemand(s Share, rate, burst, nodeRate uint64) Share {
	b := uint64(1)
	if rate > 0 {
		// In floating point: burst x nodeRate overflows 64 bits where
		// both are large (a burst is at most 3,600 s of the rate).
		b = max(uint64(float64(burst)*float64(nodeRate)/float64(rate)), 1)
	}
	s.Rate, s.Burst, s.Warning = max(nodeRate, 1), b, ""
	return s
}
