package limiter

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"
)

// A Set is the limits one request draws from, in order: a draw is
// admitted only if every limit admits it, and a refused draw takes nothing
// from any of them (the data path's all or nothing). Make one with
// Limiter.Set, once, and use it for every request: a Set is safe for
// concurrent use, and it follows its limits' configs as they change.
//
// The keys of a draw are its limits' keys, in the Set's order: keys[i]
// is the key of the i-th limit; a key-less limit ignores its key, and a
// keyed limit without one (keys shorter than the Set) draws from the key
// "".
type Set struct {
	l      *Limiter
	limits []*limit
	names  []string
}

// Names are the Set's limits, in order.
func (s *Set) Names() []string { return append([]string(nil), s.names...) }

// drawn is one limit's part of a draw: what to give back if a later limit
// refuses, and whose counters to move.
type drawn struct {
	p      *params
	sh     *shard    // key-less: the caller's shard
	ks     *keyShard // keyed: the key's shard
	e      *entry    // keyed: drawn from the key's cache (one token)
	pool   *pool     // drawn from this pool (cost), else from sh's or e's cache (one token)
	cost   int64
	waited bool
}

// undo gives back what d took.
func (d *drawn) undo() {
	switch {
	case d.pool != nil:
		d.pool.refund(d.cost)
	case d.e != nil:
		d.e.tokens.Add(1)
	case d.sh != nil:
		d.sh.tokens.Add(1)
	}
}

// count moves d's limit's counters for an admitted draw.
func (d *drawn) count() {
	switch {
	case d.sh != nil:
		d.sh.admitted.Add(1)
		if d.waited {
			d.sh.waited.Add(1)
		}
	case d.ks != nil:
		d.ks.admitted.Add(1)
		if d.waited {
			d.ks.waited.Add(1)
		}
	}
}

// refusal is why a draw was refused: the limit, and how long until the
// draw could succeed (0: never).
type refusal struct {
	limit string
	retry int64
}

// draw draws n tokens from every limit, appending what it took to ds.
// With wait, a limit whose policy is OnEmptyWait may reserve tokens that
// accrue within its MaxWait and budget ns; delay is then the longest
// reservation's. On a refusal nothing is left drawn.
func (s *Set) draw(n int64, keys []string, wait bool, budget int64, ds []drawn) (_ []drawn, delay int64, ref *refusal) {
	now, haveNow := int64(0), false
	clock := func() int64 {
		if !haveNow {
			now, haveNow = s.l.clock.Now(), true
		}
		return now
	}
	for i, l := range s.limits {
		p := l.p.Load()
		if p == nil {
			l.unknown.Add(1) // not configured (yet): nothing to enforce
			continue
		}
		var d drawn
		var pl *pool
		var ok bool
		var retry int64
		d.p = p
		if p.t == nil {
			sh := p.b.get()
			d.sh = sh
			if n == 1 && sh.takeFast() {
				p.b.put(sh)
				ds = append(ds, d)
				continue
			}
			var cached bool
			ok, cached, retry = p.b.lease(sh, &p.r, n, clock())
			p.b.put(sh)
			pl = &p.b.pool
			if ok && !cached {
				d.pool, d.cost = pl, p.r.cost(n)
			}
		} else {
			key := ""
			if i < len(keys) {
				key = keys[i]
			}
			key = p.t.canon(key)
			ks, h := p.t.shardOf(key)
			e := ks.lookup(key, h)
			if e != nil && n == 1 && e.takeFast() {
				d.ks, d.e = ks, e
				ds = append(ds, d)
				continue
			}
			if e == nil {
				e = ks.get(key, h, clock())
			}
			d.ks, pl = ks, &e.pool
			if n == 1 && p.r.chunk > 1 {
				if ok, _ = pl.take(&p.r, p.r.chunk, clock()); ok {
					e.tokens.Add(p.r.chunk - 1)
					d.e = e
				}
			}
			if !ok {
				if ok, retry = pl.take(&p.r, n, clock()); ok {
					d.pool, d.cost = pl, p.r.cost(n)
				}
			}
		}
		if ok {
			ds = append(ds, d)
			continue
		}
		if wait && p.cfg.OnEmpty == OnEmptyWait && !p.cfg.Shadow {
			limit := min(int64(p.cfg.MaxWait), budget)
			if dl, ok := pl.reserve(&p.r, n, now, limit); ok {
				d.pool, d.cost, d.waited = pl, p.r.cost(n), true
				ds = append(ds, d)
				delay = max(delay, dl)
				continue
			} else if dl > 0 {
				retry = dl
			}
		}
		d.failed()
		if p.cfg.Shadow {
			continue // admitted, counted as refused
		}
		for j := range ds {
			ds[j].undo()
		}
		return ds[:0], 0, &refusal{limit: l.name, retry: retry}
	}
	return ds, delay, nil
}

// failed counts a refusal on d's limit.
func (d *drawn) failed() {
	switch {
	case d.sh != nil:
		d.sh.failed.Add(1)
	case d.ks != nil:
		d.ks.failed.Add(1)
	}
}

// Allow reports whether a request may go now: one token from every limit
// of the Set, all or none. It never waits, whatever the limits' policy.
func (s *Set) Allow(keys ...string) bool { return s.AllowN(1, keys...) }

// AllowN is Allow for n tokens.
func (s *Set) AllowN(n int, keys ...string) bool {
	var buf [4]drawn
	ds, _, ref := s.draw(int64(n), keys, false, 0, buf[:0])
	if ref != nil {
		return false
	}
	for i := range ds {
		ds[i].count()
	}
	return true
}

// Wait draws one token from every limit, as each limit's policy says:
// with tokens there, it returns nil at once. Else, if every limit short of
// tokens waits (OnEmptyWait) and the wait is within each one's MaxWait and
// before ctx's deadline, it reserves the tokens, waits, and returns nil; a
// ctx that ends first gives the tokens back and returns its error. In
// every other case it returns a *RejectedError at once, without waiting
// and without drawing.
func (s *Set) Wait(ctx context.Context, keys ...string) error { return s.WaitN(ctx, 1, keys...) }

// WaitN is Wait for n tokens.
func (s *Set) WaitN(ctx context.Context, n int, keys ...string) error {
	budget := int64(1<<62 - 1)
	if dl, ok := ctx.Deadline(); ok {
		budget = max(int64(time.Until(dl)), 0)
	}
	var buf [4]drawn
	ds, delay, ref := s.draw(int64(n), keys, true, budget, buf[:0])
	if ref != nil {
		return &RejectedError{Limit: ref.limit, RetryAfter: time.Duration(ref.retry)}
	}
	if delay > 0 {
		start := time.Now()
		select {
		case <-s.l.clock.After(time.Duration(delay)):
		case <-ctx.Done():
			for i := range ds {
				ds[i].undo()
			}
			return fmt.Errorf("limiter: wait: %w", ctx.Err())
		}
		s.l.observeWait(ds, time.Since(start))
	}
	for i := range ds {
		ds[i].count()
	}
	return nil
}

// A Reservation is tokens a draw reserved: when they may be used, and a
// way to give them back.
type Reservation struct {
	ok     bool
	delay  time.Duration
	at     int64 // clock time they are there
	ds     []drawn
	l      *Limiter
	undone atomic.Bool
	limit  string
	retry  time.Duration
}

// OK reports whether the tokens were reserved. A reservation that is not
// OK drew nothing.
func (r *Reservation) OK() bool { return r.ok }

// Delay is how long the caller must wait before acting on the
// reservation (0: now); with OK false, how long until the draw could
// succeed (0: never).
func (r *Reservation) Delay() time.Duration {
	if !r.ok {
		return r.retry
	}
	return max(time.Duration(r.at-r.l.clock.Now()), 0)
}

// Limit is, for a reservation that is not OK, the first limit that
// refused.
func (r *Reservation) Limit() string { return r.limit }

// Cancel gives the tokens back, if the reservation's time has not come;
// after that the caller is taken to have acted, and Cancel does nothing.
func (r *Reservation) Cancel() {
	if !r.ok || r.l.clock.Now() >= r.at || !r.undone.CompareAndSwap(false, true) {
		return
	}
	for i := range r.ds {
		r.ds[i].undo()
	}
}

// Reserve reserves one token from every limit, as Wait would (the limits'
// policy and MaxWait apply; there is no deadline), without waiting: the
// caller waits Delay, or calls Cancel.
func (s *Set) Reserve(keys ...string) *Reservation { return s.ReserveN(1, keys...) }

// ReserveN is Reserve for n tokens.
func (s *Set) ReserveN(n int, keys ...string) *Reservation {
	ds, delay, ref := s.draw(int64(n), keys, true, 1<<62-1, nil)
	r := &Reservation{l: s.l}
	if ref != nil {
		r.limit, r.retry = ref.limit, time.Duration(ref.retry)
		return r
	}
	r.ok, r.ds, r.at = true, ds, s.l.clock.Now()+delay
	for i := range ds {
		ds[i].count()
	}
	return r
}

// Status is one limit's state for one key, for response headers.
type Status struct {
	// Limit is the limit's name.
	Limit string
	// Quota is what may go at once: the share's burst. 0 for a limit
	// that is not configured (it admits everything).
	Quota int64
	// Window is Quota / Rate: how long a spent quota takes to come back.
	Window time.Duration
	// Remaining is the tokens the key has now (at least 0).
	Remaining int64
	// Reset is how long until Remaining is Quota again.
	Reset time.Duration
	// Rate is the share's rate, in tokens per second.
	Rate float64
}

// Status appends to dst the state of every limit of the Set for keys,
// in order, and returns it.
func (s *Set) Status(dst []Status, keys ...string) []Status {
	now := s.l.clock.Now()
	for i, l := range s.limits {
		p := l.p.Load()
		if p == nil {
			dst = append(dst, Status{Limit: l.name})
			continue
		}
		st := Status{Limit: l.name, Quota: p.r.burst, Window: time.Duration(p.r.tau), Rate: p.cfg.Rate}
		if p.t == nil {
			tokens, full := p.b.pool.available(&p.r, now)
			st.Remaining, st.Reset = min(tokens+p.b.cached(), p.r.burst), time.Duration(full)
		} else {
			key := ""
			if i < len(keys) {
				key = keys[i]
			}
			key = p.t.canon(key)
			ks, h := p.t.shardOf(key)
			st.Remaining = p.r.burst
			if e := ks.lookup(key, h); e != nil {
				tokens, full := e.pool.available(&p.r, now)
				st.Remaining, st.Reset = tokens, time.Duration(full)
			}
		}
		dst = append(dst, st)
	}
	return dst
}
