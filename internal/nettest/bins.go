package nettest

import (
	"sync/atomic"
	"time"
)

// DefaultBin is the width of a counting bin unless configured otherwise:
// fine enough to cut a window at 1% of a second.
const DefaultBin = 10 * time.Millisecond

// Bins count events per fixed-width time bin from a start time, over a
// bounded span. One goroutine adds; any goroutine reads.
type Bins struct {
	start  time.Time
	width  time.Duration
	counts []atomic.Int64
	// outside counts events before start or after the span.
	outside atomic.Int64
	total   atomic.Int64
}

func newBins(start time.Time, width, span time.Duration) *Bins {
	if width <= 0 {
		width = DefaultBin
	}
	// Bins of the same width share one grid (multiples of the width since
	// the zero time), so a window cuts a Sender's and a Receiver's bins at
	// the same instants.
	start = start.Truncate(width)
	n := int(span/width) + 2
	return &Bins{start: start, width: width, counts: make([]atomic.Int64, n)}
}

// Start is the start of the first bin.
func (b *Bins) Start() time.Time { return b.start }

// Width is the width of a bin.
func (b *Bins) Width() time.Duration { return b.width }

func (b *Bins) add(at time.Time, n int64) {
	b.total.Add(n)
	d := at.Sub(b.start)
	if d < 0 || int(d/b.width) >= len(b.counts) {
		b.outside.Add(n)
		return
	}
	b.counts[d/b.width].Add(n)
}

// Total is every event counted, in the span or not.
func (b *Bins) Total() int64 { return b.total.Load() }

// Outside is the events that fell before the start or after the span.
func (b *Bins) Outside() int64 { return b.outside.Load() }

// index is the bin that holds t, clamped to the span.
func (b *Bins) index(t time.Time) int {
	d := t.Sub(b.start)
	if d < 0 {
		return 0
	}
	return min(int(d/b.width), len(b.counts))
}

// Count is the number of events in the bins that start in [from, to): the
// window is cut at bin boundaries, from and to rounded down.
func (b *Bins) Count(from, to time.Time) int64 {
	var n int64
	for i := b.index(from); i < b.index(to); i++ {
		n += b.counts[i].Load()
	}
	return n
}

// Rate is Count per second of the window as cut at bin boundaries; 0 for an
// empty window.
func (b *Bins) Rate(from, to time.Time) float64 {
	i, j := b.index(from), b.index(to)
	if j <= i {
		return 0
	}
	return float64(b.Count(from, to)) / (time.Duration(j-i) * b.width).Seconds()
}

// Series cuts [from, to) into windows of width (a multiple of the bin
// width, rounded down, at least one bin) and returns each window's count.
// A last partial window is left out.
func (b *Bins) Series(from, to time.Time, width time.Duration) []int64 {
	k := max(int(width/b.width), 1)
	var out []int64
	for i := b.index(from); i+k <= b.index(to); i += k {
		var n int64
		for j := i; j < i+k; j++ {
			n += b.counts[j].Load()
		}
		out = append(out, n)
	}
	return out
}
