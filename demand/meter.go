package demand

import (
	"math"
	"time"
)

// Meter turns a limit's offered counter (admitted and dropped units, as the
// data path already counts them: nothing new on the packet path) into a
// smoothed demand in units/s, an exponentially weighted moving average with
// time constant Tau, and says when it has moved enough to be reported
// again.
type Meter struct {
	// Tau is the averaging time constant: a step in demand shows 63% of
	// its height after Tau, 95% after 3 x Tau.
	Tau time.Duration

	count uint64
	at    time.Time
	rate  float64
	last  float64 // the last interval's rate
	warm  bool    // one interval measured: rate is an estimate
}

// Observe takes the counter's value at now and returns the smoothed demand.
// A counter that went backwards (the limit was installed again, its
// counters at zero) starts the average over: the next interval's rate
// replaces the estimate, which stands until then.
func (m *Meter) Observe(count uint64, now time.Time) float64 {
	switch {
	case m.at.IsZero() || count < m.count:
		m.count, m.at, m.warm = count, now, false
		return m.rate
	case !now.After(m.at):
		return m.rate
	}
	dt := now.Sub(m.at)
	r := float64(count-m.count) / dt.Seconds()
	m.last = r
	if !m.warm {
		m.rate, m.warm = r, true
	} else {
		a := 1 - math.Exp(-dt.Seconds()/m.Tau.Seconds())
		m.rate += a * (r - m.rate)
	}
	m.count, m.at = count, now
	return m.rate
}

// Demand is the smoothed demand, units/s, and whether an interval has been
// measured.
func (m *Meter) Demand() (float64, bool) { return m.rate, m.warm }

// Settled reports whether the last interval's rate is within the fraction
// rel of the estimate: the average has caught up with a step in demand, and
// reporting it now does not report a point on its way.
func (m *Meter) Settled(rel float64) bool {
	return m.warm && math.Abs(m.last-m.rate) <= rel*max(m.rate, m.last)
}

// Moved reports whether demand differs from the last reported one by more
// than the fraction rel of the larger of the two and by more than abs
// units/s: what is worth a write to the API server. Small jitter around a
// steady demand is not; a node going idle or busy is.
func Moved(reported, demand, rel, abs float64) bool {
	d := math.Abs(demand - reported)
	return d > abs && d > rel*max(reported, demand)
}
