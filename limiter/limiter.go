package limiter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Options configure a Limiter. The zero value is valid: limits only from
// Apply, 100,000 keys per keyed limit, no metrics, slog.Default, the real
// clock.
type Options struct {
	// Source tells the limiter its limits and shares (Run runs it).
	// (Optional) nil: only Apply sets limits.
	Source Source
	// MaxKeys is how many keys a keyed limit holds at once; beyond it an
	// idle key is evicted (one that owes is remembered: see Set).
	// (Optional) 0: DefaultMaxKeys.
	MaxKeys int
	// Registerer gets the limiter's metrics (docs/library.md).
	// (Optional) nil: no metrics.
	Registerer prometheus.Registerer
	// Logger logs config changes. (Optional) nil: slog.Default().
	Logger *slog.Logger
	// Clock is the limiter's time. (Optional) nil: the real clock.
	Clock Clock
}

// DefaultMaxKeys is Options.MaxKeys' default.
const DefaultMaxKeys = 100_000

// A Limiter enforces named limits, each with its share at this replica
// and its policy, on the requests of one process. Its limits come from a
// Source (Run) or from Apply; Sets draw from them. Safe for concurrent
// use.
type Limiter struct {
	opts  Options
	clock Clock
	log   *slog.Logger
	waits *prometheus.HistogramVec

	mu     sync.Mutex
	limits map[string]*limit // never removed: Sets hold them
}

// limit is one named limit: its current params (nil: not configured) and
// the counters that outlive them.
type limit struct {
	name    string
	p       atomic.Pointer[params]
	unknown atomic.Uint64
	wait    prometheus.Observer // nil without metrics

	// The counters of buckets and tables a config change replaced (under
	// Limiter.mu).
	base struct{ admitted, failed, waited, evicted uint64 }
}

// params is one config of a limit, and its buckets.
type params struct {
	cfg  LimitConfig
	wait prometheus.Observer // the limit's, nil without metrics
	r    rates
	b    *bucket // key-less
	t    *table  // keyed
}

// New returns a Limiter, or an error naming the option that is invalid.
func New(opts Options) (*Limiter, error) {
	if opts.MaxKeys < 0 {
		return nil, fmt.Errorf("limiter: MaxKeys %d: 0 (default %d) or more", opts.MaxKeys, DefaultMaxKeys)
	}
	if opts.MaxKeys == 0 {
		opts.MaxKeys = DefaultMaxKeys
	}
	l := &Limiter{opts: opts, clock: opts.Clock, log: opts.Logger, limits: make(map[string]*limit)}
	if l.clock == nil {
		l.clock = realClock{base: time.Now()}
	}
	if l.log == nil {
		l.log = slog.Default()
	}
	if r := opts.Registerer; r != nil {
		l.waits = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "rlagent_limiter_wait_seconds",
			Help:    "How long the draws that waited waited, by limit (the longest of a Set's).",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"limit"})
		if err := r.Register(l.waits); err != nil {
			return nil, fmt.Errorf("limiter: register metrics: %w", err)
		}
		if err := r.Register(&collector{l: l}); err != nil {
			return nil, fmt.Errorf("limiter: register metrics: %w", err)
		}
	}
	return l, nil
}

// Run runs Options.Source until ctx ends, applying every change of the
// limits (a change that Apply rejects is logged, and the limits stay as
// they were). Without a Source it waits for ctx.
func (l *Limiter) Run(ctx context.Context) error {
	if l.opts.Source == nil {
		<-ctx.Done()
		return nil
	}
	return l.opts.Source.Run(ctx, func(cfgs []LimitConfig) {
		if err := l.Apply(cfgs); err != nil {
			l.log.Error("limits not applied; the previous ones stay", "error", err)
		}
	})
}

// Set returns the Set of the named limits, in this order. A name not
// configured (yet) admits every draw, counted
// (rlagent_limiter_unknown_total), until Apply configures it: a Set
// follows its names.
func (l *Limiter) Set(names ...string) *Set {
	s := &Set{l: l, names: slices.Clone(names)}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, n := range names {
		s.limits = append(s.limits, l.limitLocked(n))
	}
	return s
}

func (l *Limiter) limitLocked(name string) *limit {
	lim := l.limits[name]
	if lim == nil {
		lim = &limit{name: name}
		if l.waits != nil {
			lim.wait = l.waits.WithLabelValues(name)
		}
		l.limits[name] = lim
	}
	return lim
}

// Config returns the named limit's config, if it is configured.
func (l *Limiter) Config(name string) (LimitConfig, bool) {
	l.mu.Lock()
	lim := l.limits[name]
	l.mu.Unlock()
	if lim == nil {
		return LimitConfig{}, false
	}
	if p := lim.p.Load(); p != nil {
		return p.cfg, true
	}
	return LimitConfig{}, false
}

// Apply makes cfgs the limits, whole: a limit not in cfgs is no longer
// configured (its Sets admit). A config that is not valid fails the whole
// Apply, with every problem named, and the limits stay as they were. A
// changed limit keeps what its keys owe: a draw in flight finishes on the
// old config, the next takes the new one.
func (l *Limiter) Apply(cfgs []LimitConfig) error {
	if err := validate(cfgs); err != nil {
		return fmt.Errorf("limiter: %w", err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	seen := make(map[string]bool, len(cfgs))
	for _, c := range cfgs {
		seen[c.Name] = true
		if c.OnEmpty == "" {
			c.OnEmpty = OnEmptyFail
		}
		lim := l.limitLocked(c.Name)
		old := lim.p.Load()
		p := &params{cfg: c, wait: lim.wait}
		switch {
		case old != nil && old.cfg.Keyed == c.Keyed:
			p.b, p.t = old.b, old.t // the same buckets: what they owe stands
		case c.Keyed:
			p.t = newTable(l.opts.MaxKeys)
		default:
			p.b = newBucket()
		}
		if old != nil && (old.b != p.b || old.t != p.t) {
			lim.retire(old)
		}
		shards := 1 // a key's cache
		if p.b != nil {
			shards = len(p.b.shards)
		}
		p.r = newRates(c.Rate, c.Burst, c.MaxWait, shards)
		if old == nil || old.cfg != c {
			l.log.Info("limit configured", "limit", c.Name, "rate", c.Rate, "burst", c.Burst, "keyed", c.Keyed,
				"onEmpty", c.OnEmpty, "maxWait", c.MaxWait, "shadow", c.Shadow, "replicas", c.Replicas, "globalRate", c.GlobalRate)
		}
		lim.p.Store(p)
		if old != nil && old.cfg != c {
			// The same buckets under a new config: what they owe stands,
			// up to what the new config could owe.
			now := l.clock.Now()
			if p.b != nil && p.b == old.b {
				p.b.rebase(&p.r, now)
			}
			if p.t != nil && p.t == old.t {
				p.t.rebase(&p.r, now)
			}
		}
	}
	for name, lim := range l.limits {
		if old := lim.p.Load(); old != nil && !seen[name] {
			l.log.Info("limit removed: its Sets admit", "limit", name)
			lim.retire(old)
			lim.p.Store(nil)
		}
	}
	return nil
}

// retire keeps the counters of buckets that old's replacement does not
// keep. Callers hold Limiter.mu.
func (lim *limit) retire(old *params) {
	a, f, w, e := old.counts()
	lim.base.admitted += a
	lim.base.failed += f
	lim.base.waited += w
	lim.base.evicted += e
}

func (p *params) counts() (admitted, failed, waited, evicted uint64) {
	if p.t != nil {
		a, f, w, _, e := p.t.counts()
		return a, f, w, e
	}
	a, f, w := p.b.counts()
	return a, f, w, 0
}

// validate checks configs as Apply takes them.
func validate(cfgs []LimitConfig) error {
	var errs []error
	seen := make(map[string]bool)
	for i, c := range cfgs {
		at := fmt.Sprintf("limits[%d] (%s)", i, c.Name)
		switch {
		case c.Name == "":
			errs = append(errs, fmt.Errorf("limits[%d].Name: required", i))
		case seen[c.Name]:
			errs = append(errs, fmt.Errorf("%s.Name: listed twice", at))
		}
		seen[c.Name] = true
		if !(c.Rate > 0) || math.IsInf(c.Rate, 0) || c.Rate > 1e12 {
			errs = append(errs, fmt.Errorf("%s.Rate: %v is not in (0, 1e12] requests per second", at, c.Rate))
		}
		if c.Burst < 1 {
			errs = append(errs, fmt.Errorf("%s.Burst: %d is not at least 1", at, c.Burst))
		}
		switch c.OnEmpty {
		case "", OnEmptyFail:
			if c.MaxWait != 0 {
				errs = append(errs, fmt.Errorf("%s.MaxWait: only with OnEmpty %q", at, OnEmptyWait))
			}
		case OnEmptyWait:
			if c.MaxWait <= 0 {
				errs = append(errs, fmt.Errorf("%s.MaxWait: %v: a wait needs a bound above 0", at, c.MaxWait))
			}
		default:
			errs = append(errs, fmt.Errorf("%s.OnEmpty: %q is not one of %s, %s", at, c.OnEmpty, OnEmptyFail, OnEmptyWait))
		}
	}
	return errors.Join(errs...)
}

// observeWait records a draw's wait on the limits that waited.
func (l *Limiter) observeWait(ds []drawn, d time.Duration) {
	for i := range ds {
		if ds[i].waited && ds[i].p.wait != nil {
			ds[i].p.wait.Observe(d.Seconds())
		}
	}
}
