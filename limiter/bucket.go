package limiter

import (
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// The token bucket is the data path's, in Go (docs/datapath.md): a GCRA
// pool, one "theoretical arrival time" (tat) per bucket, from which
// per-shard caches lease tokens in chunks.
//
// A pool of rate r and burst b holds, at time now, (now + tau - max(tat,
// now)) / T tokens, T = 1/r and tau = b x T. Refill is implicit (time
// passing), so nothing ever writes a refill, and a draw of n tokens is one
// compare-and-swap of tat to max(tat, now) + n x T, allowed while the new
// tat is at most now + tau. A reservation (a draw that waits) moves tat
// beyond that, and waits until it is back within tau: the pool is then a
// virtual clock, and waiters are served in the order they reserved, at
// exactly the rate.

// rates is what one config of a limit makes of its rate and burst.
type rates struct {
	tns   float64 // T: nanoseconds per token
	tau   int64   // burst x T: how far tat may run ahead of now
	burst int64
	chunk int64 // tokens a shard leases at once (key-less limits)
	// horizon is tau plus MaxWait: how far tat can run ahead of now
	// under this config. A config change keeps a bucket's debt in time,
	// but clamps it to the new horizon (clampDebt), so that a smaller
	// burst does not leave a key owing more than the new one could.
	horizon int64
	// stale is how long a shard's lease lasts before another shard gives
	// its remainder back to the pool: twice the time a chunk lasts when
	// the rate is spread over every shard, and at least staleLease.
	stale int64
}

// staleLease is the shortest time after which a shard that has not
// leased gives its tokens back ("a few ms", as the data path).
const staleLease = 4 * time.Millisecond

func newRates(rate float64, burst int64, maxWait time.Duration, shards int) rates {
	r := rates{tns: 1e9 / rate, burst: burst}
	r.tau = int64(math.Min(float64(burst)*r.tns, math.MaxInt64/4))
	r.horizon = r.tau + int64(min(maxWait, time.Duration(math.MaxInt64/4)))
	// chunk = clamp(rate x 1 ms, 1, burst / (8 x shards)): the tokens
	// stranded in the shards are at most shards x (chunk - 1) <= burst / 8.
	// A keyed limit's key has one cache: shards is 1.
	r.chunk = max(min(int64(rate/1000), burst/int64(8*shards)), 1)
	r.stale = int64(math.Min(math.Max(float64(staleLease), 2*float64(r.chunk*int64(shards))*r.tns), math.MaxInt64/4))
	return r
}

// clampDebt moves tat back to at most now + horizon: a config change
// keeps what the pool owes, up to what the new config could owe.
func (p *pool) clampDebt(now, horizon int64) {
	for {
		tat := p.tat.Load()
		if tat <= now+horizon || p.tat.CompareAndSwap(tat, now+horizon) {
			return
		}
	}
}

// cost is how far n tokens move tat: n x T, rounded up.
func (r *rates) cost(n int64) int64 {
	return int64(math.Min(math.Ceil(float64(n)*r.tns), math.MaxInt64/4))
}

// pool is one bucket's tat. A key-less bucket's is alone on its cache
// line (bucket pads it); a key's shares its line with the key's cache.
type pool struct {
	tat atomic.Int64
}

// take draws n tokens at now if they are there: ok, or how long until
// they would be (0 if never: n above the burst).
func (p *pool) take(r *rates, n, now int64) (ok bool, retry int64) {
	c := r.cost(n)
	if c > r.tau {
		return false, 0
	}
	for {
		tat := p.tat.Load()
		next := max(tat, now) + c
		if over := next - now - r.tau; over > 0 {
			return false, over
		}
		if p.tat.CompareAndSwap(tat, next) {
			return true, 0
		}
	}
}

// reserve draws n tokens that may not be there yet, if they will be
// within limit ns: the delay until they are (0: now), ok false if not
// within limit (retry: the delay it would have been; 0 if never).
func (p *pool) reserve(r *rates, n, now, limit int64) (delay int64, ok bool) {
	c := r.cost(n)
	if c > r.tau {
		return 0, false
	}
	for {
		tat := p.tat.Load()
		next := max(tat, now) + c
		delay = max(next-now-r.tau, 0)
		if delay > limit {
			return delay, false
		}
		if p.tat.CompareAndSwap(tat, next) {
			return delay, true
		}
	}
}

// refund gives back what a draw of cost ns took.
func (p *pool) refund(c int64) { p.tat.Add(-c) }

// available is what the pool holds at now, and how long until it is full.
func (p *pool) available(r *rates, now int64) (tokens int64, full int64) {
	tat := max(p.tat.Load(), now)
	return max(int64(float64(now+r.tau-tat)/r.tns), 0), tat - now
}

// shard is one cache of a key-less bucket's tokens, with the limit's
// counters, alone on its cache line: a call touches its own shard only,
// so that calls on other processors do not contend.
type shard struct {
	tokens   atomic.Int64  // leased from the pool, not yet drawn
	admitted atomic.Uint64 // draws admitted
	failed   atomic.Uint64 // draws refused (shadow: would have been)
	waited   atomic.Uint64 // draws that waited
	leased   atomic.Int64  // when the shard last leased a chunk
	sweep    atomic.Uint32 // the next shard this one looks at for a stale lease
	_        [20]byte
}

// bucket is a key-less limit's: a pool and its shards.
//
// A call picks its shard through a sync.Pool of shard pointers: Get takes
// the calling P's private one (P: the scheduler's processor, which runs
// one goroutine at a time) and Put gives it back, so that in steady state
// each P keeps drawing from its own shard, as each CPU draws from its own
// cache in the data path. A P without one (at start, or after a garbage
// collection emptied the sync.Pool) gets the next shard in turn. Nothing
// depends on the pick for accuracy: every shard operation is atomic.
type bucket struct {
	pool   pool
	_      [56]byte
	shards []shard
	next   atomic.Uint32
	picker sync.Pool
}

func newBucket() *bucket {
	n := 1
	for n < runtime.GOMAXPROCS(0) {
		n <<= 1
	}
	b := &bucket{shards: make([]shard, n)}
	b.picker.New = func() any {
		return &b.shards[int(b.next.Add(1)-1)%len(b.shards)]
	}
	return b
}

func (b *bucket) get() *shard  { return b.picker.Get().(*shard) }
func (b *bucket) put(s *shard) { b.picker.Put(s) }

// takeFast draws one token from s's cache, without the clock.
func (s *shard) takeFast() bool {
	if s.tokens.Add(-1) >= 0 {
		return true
	}
	s.tokens.Add(1)
	return false
}

// lease draws n tokens for s's caller from the pool at now. For one
// token it leases a chunk when it can, keeping the rest in s's cache
// (cached: the token came through the cache, and goes back there if the
// draw is undone); else it draws the n tokens alone.
func (b *bucket) lease(s *shard, r *rates, n, now int64) (ok, cached bool, retry int64) {
	b.reclaim(s, r, now)
	if n == 1 && r.chunk > 1 {
		if ok, _ := b.pool.take(r, r.chunk, now); ok {
			s.tokens.Add(r.chunk - 1)
			s.leased.Store(now)
			return true, true, 0
		}
	}
	ok, retry = b.pool.take(r, n, now)
	return ok, false, retry
}

// reclaim gives back to the pool what one other shard (each in turn)
// holds, if that shard has not leased for r.stale: its processor stopped
// drawing, or its goroutines moved. Else its tokens would stay out of the
// pool until it draws again, and come back then on top of a pool that
// has refilled: a burst of up to burst + burst/8 after a quiet spell.
// Only a lease runs it (it reads the clock anyway), so it costs the fast
// path nothing. With traffic on every shard no lease goes stale.
func (b *bucket) reclaim(s *shard, r *rates, now int64) {
	if len(b.shards) == 1 {
		return
	}
	o := &b.shards[s.sweep.Add(1)%uint32(len(b.shards))]
	if o == s || now-o.leased.Load() < r.stale {
		return
	}
	if v := o.tokens.Load(); v > 0 && o.tokens.CompareAndSwap(v, 0) {
		b.pool.refund(r.cost(v))
	}
}

// rebase carries the bucket over to a new config r: the shards' caches
// go back to the pool (a chunk of the old config may exceed the new
// burst), and the pool's debt is clamped (pool.clampDebt).
func (b *bucket) rebase(r *rates, now int64) {
	for i := range b.shards {
		s := &b.shards[i]
		if v := s.tokens.Load(); v > 0 && s.tokens.CompareAndSwap(v, 0) {
			b.pool.refund(r.cost(v))
		}
	}
	b.pool.clampDebt(now, r.horizon)
}

// counts sums the shards' counters.
func (b *bucket) counts() (admitted, failed, waited uint64) {
	for i := range b.shards {
		s := &b.shards[i]
		admitted += s.admitted.Load()
		failed += s.failed.Load()
		waited += s.waited.Load()
	}
	return
}

// cached is the tokens the shards hold.
func (b *bucket) cached() int64 {
	var n int64
	for i := range b.shards {
		n += max(b.shards[i].tokens.Load(), 0)
	}
	return n
}
