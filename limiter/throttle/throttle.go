package throttle

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"time"
)

// ErrThrottled is the error of a request the throttle refused locally: it
// never reached the backend. Match it with errors.Is.
var ErrThrottled = errors.New("throttled locally")

// Defaults of Options' zero values.
const (
	DefaultK      = 2.0
	DefaultWindow = 2 * time.Minute
)

// buckets is the number of buckets in the window's ring. 32 buckets of a
// 2-minute window are 3.75 s each; the oldest bucket is weighed by the part
// of it still in the window (see Throttle.counts), so the bucket size
// bounds the window's granularity, not its accuracy.
const buckets = 32

// Options configure a Throttle. The zero value is the book's throttle.
type Options struct {
	// K is how many times the backend's accepts the client may send:
	// at 2 (the default) the backend receives up to twice what it
	// accepts. Lower is more aggressive (1 lets through only what was
	// accepted, so the client is slow to notice a recovery); higher lets
	// more wasted requests reach the backend. (Optional) 0 means
	// DefaultK; else at least 1.
	K float64
	// Window is the span over which requests and accepts are counted.
	// (Optional) 0 means DefaultWindow; else at least 32 µs.
	Window time.Duration
	// Now reads the time. (Optional) nil means time.Now; tests set a
	// fake. It must be monotonic (time.Now is).
	Now func() time.Time
	// Rand returns a uniform float64 in [0, 1); Allow calls it while the
	// reject probability is above 0, with the throttle's lock held, so it
	// need not be safe for concurrent use (a *rand.Rand's Float64 will
	// do). (Optional) nil means math/rand/v2's Float64.
	Rand func() float64
}

// counts is a pair of counters: requests and, of them, accepts.
type counts struct {
	requests, accepts int64
}

// A Throttle is one client's adaptive throttle. Create it with New.
type Throttle struct {
	k     float64
	width int64 // ns per bucket
	now   func() time.Time
	rand  func() float64
	base  time.Time

	mu sync.Mutex
	// cur is the absolute number of the current bucket: (now-base)/width.
	cur int64
	// ring[i%buckets] is bucket i, for i in (cur-buckets, cur].
	ring [buckets]counts
	// sum is the sum of ring.
	sum counts
	// old is bucket cur-buckets, the one that left the ring last; part of
	// it is still in the window.
	old counts
}

// New returns a Throttle, or an error naming the option that is invalid.
func New(opts Options) (*Throttle, error) {
	k := opts.K
	switch {
	case k == 0:
		k = DefaultK
	case math.IsNaN(k) || math.IsInf(k, 0) || k < 1:
		return nil, fmt.Errorf("throttle: K is %v: want 0 (default %v) or a finite number >= 1", opts.K, DefaultK)
	}
	window := opts.Window
	switch {
	case window == 0:
		window = DefaultWindow
	case window < buckets*time.Microsecond:
		return nil, fmt.Errorf("throttle: Window is %v: want 0 (default %v) or at least %v", opts.Window, DefaultWindow, buckets*time.Microsecond)
	}
	t := &Throttle{
		k:     k,
		width: int64(window) / buckets,
		now:   opts.Now,
		rand:  opts.Rand,
	}
	if t.now == nil {
		t.now = time.Now
	}
	if t.rand == nil {
		t.rand = rand.Float64
	}
	t.base = t.now()
	return t, nil
}

// Allow reports whether to send a request now. It refuses with the
// probability max(0, (requests - K×accepts) / (requests + 1)) and counts a
// refusal as a request (not an accept). A request it allows is not counted
// until Record says how the backend answered.
func (t *Throttle) Allow() bool {
	now := t.now()
	t.mu.Lock()
	t.advance(now)
	requests, accepts := t.counts(now)
	p := (requests - t.k*accepts) / (requests + 1)
	if p <= 0 {
		t.mu.Unlock()
		return true
	}
	// The draw is under the lock: Allow stays one critical section, and
	// Options.Rand needs no lock of its own.
	if t.rand() >= p {
		t.mu.Unlock()
		return true
	}
	t.add(1, 0)
	t.mu.Unlock()
	return false
}

// Record counts a request that went to the backend: accepted is whether
// the backend took it (any answer but a rejection; see the package
// documentation). Call it once per request Allow allowed, when the answer
// is known; a request whose answer says nothing of the backend (the caller
// cancelled it) may go unrecorded.
func (t *Throttle) Record(accepted bool) {
	now := t.now()
	var a int64
	if accepted {
		a = 1
	}
	t.mu.Lock()
	t.advance(now)
	t.add(1, a)
	t.mu.Unlock()
}

// Stats is a Throttle's state at one instant.
type Stats struct {
	// Requests and Accepts are the window's counts; the oldest bucket
	// weighs by its part still in the window, hence the fractions.
	Requests, Accepts float64
	// RejectProbability is the probability that Allow refuses now.
	RejectProbability float64
}

// Stats returns the throttle's counts and reject probability now.
func (t *Throttle) Stats() Stats {
	now := t.now()
	t.mu.Lock()
	t.advance(now)
	requests, accepts := t.counts(now)
	t.mu.Unlock()
	return Stats{
		Requests:          requests,
		Accepts:           accepts,
		RejectProbability: max(0, (requests-t.k*accepts)/(requests+1)),
	}
}

// elapsed is now in ns since the throttle's base, never negative.
func (t *Throttle) elapsed(now time.Time) int64 {
	return max(0, int64(now.Sub(t.base)))
}

// advance moves the ring to the bucket of now, clearing the buckets that
// leave it. It clears at most buckets+1 of them however long the throttle
// was idle. t.mu is held.
func (t *Throttle) advance(now time.Time) {
	idx := t.elapsed(now) / t.width
	if idx <= t.cur {
		// Same bucket, or a clock that went back (a fake one): stay.
		return
	}
	steps := min(idx-t.cur, buckets+1)
	for i := int64(1); i <= steps; i++ {
		slot := &t.ring[(t.cur+i)%buckets]
		t.old = *slot
		t.sum.requests -= slot.requests
		t.sum.accepts -= slot.accepts
		*slot = counts{}
	}
	if idx-t.cur > buckets {
		// Even the bucket before the ring is older than the window.
		t.old = counts{}
	}
	t.cur = idx
}

// counts returns the window's requests and accepts at now: the ring, whose
// buckets cover (buckets-1) bucket widths plus the current bucket's elapsed
// part, and of the old bucket the rest of a window. t.mu is held and now
// is in the current bucket.
func (t *Throttle) counts(now time.Time) (requests, accepts float64) {
	into := t.elapsed(now) - t.cur*t.width // ns into the current bucket
	// A clock that went back (into < 0) keeps the whole old bucket.
	rest := min(1, max(0, 1-float64(into)/float64(t.width)))
	requests = float64(t.sum.requests) + rest*float64(t.old.requests)
	accepts = float64(t.sum.accepts) + rest*float64(t.old.accepts)
	return requests, accepts
}

// add counts into the current bucket. t.mu is held.
func (t *Throttle) add(requests, accepts int64) {
	slot := &t.ring[t.cur%buckets]
	slot.requests += requests
	slot.accepts += accepts
	t.sum.requests += requests
	t.sum.accepts += accepts
}
