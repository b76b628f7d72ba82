package agent

import (
	"cmp"
	stdmaps "maps"
	"math/bits"
	"slices"
	"strings"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/demand"
	"github.com/rlagent/rlagent/maps"
)

// Keyed demand shares, this node's part: the keys the data path records as
// hot (observeHotKeys), what each key takes of a share of its own (keyUse),
// the report of at most hotKeys keys a limit (hotDemands), and each key's
// share from the allocation (stepKeys, demand.KeyNodes), which the plan
// writes to the data path as the key's own share. The report and the
// allocation are cluster.DemandPublisher's and cluster.StatusWriter's.

// keyUse is a key's use of its own share: the units its bucket handed out
// at the last read (leased, at), and the rate, units/s, between the last
// two reads (a quarter of an interval, at most a second).
type keyUse struct {
	leased uint64
	at     time.Time
	rate   float64
	rated  bool // rate holds a measurement
}

// hotKey is a key the data path recorded as short of tokens: the units it
// turned away in the two latest ticks recorded (tick is the latest), and
// when a record of it was last read.
type hotKey struct {
	tick  uint32
	short [2]uint64 // short[0]: tick's; short[1]: the tick before's
	seen  time.Time
}

// demand is the key's demand, units/s, at share: what it gets and what it
// turned away per second, over the worse of its two latest ticks.
func (h *hotKey) demand(share uint64, tick time.Duration) float64 {
	return float64(share) + float64(max(h.short[0], h.short[1]))/tick.Seconds()
}

// stepKeys steps the keys' shares of a keyed demand-shared limit (the
// key-less Node of st only checks the allocation: its level is the keys'
// floor) and reports whether one changed. Every key followed has a share
// of its own in the data path, the equal one included, so that its use is
// measured (keyUse) while it is in the allocation. Callers hold a.mu.
func (a *Agent) stepKeys(l *v1alpha1.Limit, st *demandState, alloc demand.Allocation, now time.Time) bool {
	if st.keys == nil {
		st.keys = &demand.KeyNodes{}
		st.keys.Interval, st.keys.StaleAfter, st.keys.Bounds = st.node.Interval, st.node.StaleAfter, st.node.Bounds
		// A restarted agent: the keys' shares the data path holds.
		for key, rate := range a.enforcedKeyShares(l) {
			st.keys.Start(key, rate, now)
		}
	}
	st.keys.Interval, st.keys.StaleAfter, st.keys.Bounds = st.node.Interval, st.node.StaleAfter, st.node.Bounds
	// Each key's Node checks its round as the limit's does (demand.Check:
	// the same time and floor, the key's water and nodes), and goes on
	// as if it were stale when it fails.
	shares := st.keys.Shares(alloc, a.k8s.AllocationKeys(l.Name), st.equal, now)
	st.floor = 0
	if st.node.Fresh(alloc, now) && st.node.Refused() == nil {
		st.floor = alloc.Level.Floor
	}
	same := len(shares) == len(st.shares)
	for key, rate := range shares {
		if old, ok := st.shares[key]; !ok || old != rate {
			same = false
		}
	}
	st.shares = shares
	return !same
}

// enforcedKeyShares is, by key, the rate of each key share the data path
// holds for limit l. Callers hold a.mu.
func (a *Agent) enforcedKeyShares(l *v1alpha1.Limit) map[string]uint64 {
	metas, err := a.dp.Metas()
	if err != nil {
		return nil
	}
	for id, m := range metas {
		if m.Name != l.Name {
			continue
		}
		ks, err := a.dp.KeyShares(id)
		if err != nil {
			return nil
		}
		out := make(map[string]uint64, len(ks))
		for b, s := range ks {
			out[keyOfBucket(b)] = s.Rate
		}
		return out
	}
	return nil
}

// hotShift is the data path's hot-key tick for a report interval: the
// largest power of two ns within a quarter of it (2^27 ns, 0.13 s, for
// 1 s; 2^31 ns, 2.1 s, for the default 15 s), so that a key turns hot well
// within an interval.
func hotShift(interval time.Duration) uint32 {
	s := uint32(max(bits.Len64(uint64(max(interval/4, 1))), 1) - 1)
	return min(max(s, 20), 36)
}

// hotTick is the hot-key tick's length for a report interval.
func hotTick(interval time.Duration) time.Duration {
	return time.Duration(1) << hotShift(interval)
}

// observeHotKeys reads the keys the data path recorded as hot into their
// limits' states. It reads the latest tick again at the next call (a CPU
// may record a key in it after this read), and primes itself on its first
// call: what the rings held before is not this agent's to count. Callers
// hold a.mu.
func (a *Agent) observeHotKeys(metas map[uint32]maps.Meta, now time.Time) {
	if !slices.ContainsFunc(slices.Collect(stdmaps.Values(a.demand)), func(st *demandState) bool { return st.keys != nil }) {
		return
	}
	recs, err := a.dp.HotKeys(a.hotSince)
	if err != nil {
		a.logOnce("hot keys", "read the data path's hot keys", "error", err)
		return
	}
	newest, primed := a.hotSince, a.hotPrimed
	for _, r := range recs {
		if int32(r.Tick-newest) > 0 {
			newest = r.Tick
		}
		st := a.demand[metas[r.ID].Name]
		if !primed || st == nil || st.keys == nil {
			continue
		}
		if st.hot == nil {
			st.hot = make(map[string]*hotKey)
		}
		key := keyOfBucket(r.Key)
		h := st.hot[key]
		// A tick newer than the key's latest makes it seen now: the
		// latest tick, read again, does not.
		switch {
		case h == nil && r.Tick == a.hotSince:
			// The latest tick of the last read, read again: a key that
			// cooled since does not turn hot on it.
		case h == nil:
			st.hot[key] = &hotKey{tick: r.Tick, short: [2]uint64{r.Short, 0}, seen: now}
		case int32(r.Tick-h.tick) > 0:
			prev := h.short[0]
			if r.Tick != h.tick+1 {
				prev = 0
			}
			h.tick, h.short, h.seen = r.Tick, [2]uint64{r.Short, prev}, now
		case r.Tick == h.tick:
			h.short[0] = max(h.short[0], r.Short)
		case r.Tick == h.tick-1:
			h.short[1] = max(h.short[1], r.Short)
		}
	}
	a.hotSince, a.hotPrimed = newest, true

	usage, err := a.dp.KeyUsage()
	if err != nil {
		a.logOnce("key usage", "read the keys' use of their shares", "error", err)
		return
	}
	for _, st := range a.demand {
		if st.keys == nil {
			continue
		}
		seen := make(map[string]bool)
		for id, m := range metas {
			if a.demand[m.Name] != st {
				continue
			}
			for b, leased := range usage[id] {
				key := keyOfBucket(b)
				seen[key] = true
				if st.use == nil {
					st.use = make(map[string]*keyUse)
				}
				u := st.use[key]
				switch {
				case u == nil:
					st.use[key] = &keyUse{leased: leased, at: now}
				case leased < u.leased:
					u.leased, u.at = leased, now // its share was written again
				default:
					if dt := now.Sub(u.at).Seconds(); dt > 0 {
						u.rate, u.rated = float64(leased-u.leased)/dt, true
					}
					u.leased, u.at = leased, now
				}
			}
		}
		for key := range st.use {
			if !seen[key] {
				delete(st.use, key) // no share of its own any more
			}
		}
	}
}

// hotDemands is the demands of at most n of the limit's hot keys, those
// asking the most, at its shares now; keys not recorded for cool (an
// interval, and the period the records are read at) cool: they are not
// reported again until recorded again. A key not recorded for short (two
// ticks and that period) is no longer short of tokens: until it cools it
// asks for what it takes of its share. It keeps at most 4 n keys.
func (st *demandState) hotDemands(n int, now time.Time, cool, short, tick time.Duration) map[string]float64 {
	type kd struct {
		key string
		d   float64
	}
	all := make([]kd, 0, len(st.hot)+len(st.use))
	for key, h := range st.hot {
		if now.Sub(h.seen) > cool {
			delete(st.hot, key)
		}
	}
	for key, h := range st.hot {
		share, ok := st.shares[key]
		if !ok {
			share = st.equal
		}
		u := st.use[key]
		var d float64
		switch {
		case now.Sub(h.seen) <= short:
			// Short of tokens now: it took its share, and asks for
			// what it was short of besides.
			d = h.demand(share, tick)
			if u != nil {
				d = max(d, u.rate+h.demand(0, tick))
			}
		case u != nil:
			d = u.rate // not short any more: what it takes, until it cools
		default:
			d = float64(share)
		}
		all = append(all, kd{key, d})
	}
	for key, u := range st.use {
		if _, hot := st.hot[key]; hot || st.shares[key] <= st.floor || u.rate <= float64(st.floor)+1 {
			continue
		}
		// Not short, but taking more than the floor of a share of its
		// own: what it takes.
		all = append(all, kd{key, u.rate})
	}
	slices.SortFunc(all, func(x, y kd) int { return cmp.Or(cmp.Compare(y.d, x.d), strings.Compare(x.key, y.key)) })
	for _, k := range all[min(len(all), 4*n):] {
		delete(st.hot, k.key)
	}
	out := make(map[string]float64, min(len(all), n))
	for _, k := range all[:min(len(all), n)] {
		out[k.key] = k.d
	}
	return out
}
