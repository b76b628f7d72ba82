package watcher

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
)

// watchHealth dates the observations from the informers' own list and watch
// calls, so that an agent asks the API server nothing beyond its watches
// while the API server answers: with every watch open, what the listers
// hold is current; once a call fails, the observations are as old as the
// first failure, and their age grows until every informer has listed or
// watched again.
//
// A watch can look open on a connection that died silently (a partition,
// no reset): client-go's HTTP/2 health check (a ping after 30 s without a
// frame, 15 s to answer) closes it, so such an outage shows within about
// 45 s. A refused connection or a stopped API server shows at once.
//
// While a failure means that the API server does not answer (no answer, or
// a 5xx), the informers' calls wait for it instead of failing: a probe
// (GET /readyz every ProbeInterval, only then) opens the gate when it is
// back. Why: client-go's reflector retries a failed call with an exponential
// backoff (0.8 s doubling to 30 s, jittered up to twice that) and relists
// after an expired watch with the same backoff, so after an outage of half
// a minute the informers came back 25-90 s after the API server did
// (measured in test/k8s). Held here, the calls fail only once, the backoff
// stays at its first step, and the informers resume within a ProbeInterval
// of the API server's return.
type watchHealth struct {
	log      *slog.Logger
	probe    func(context.Context) error
	interval time.Duration
	changed  func() // called (without the lock) when the health changes

	mu      sync.Mutex
	failing map[string]failure // by informer; absent: its last call worked
	down    bool               // the last failure was "not answering": calls wait
	probing bool
	wake    chan struct{} // closed when down ends

	events sync.Map        // informer name -> *eventCounts
	run    context.Context // the source's Run: the probe ends with it
}

// runCtx is the context the probe runs in: the source's, once it runs.
func (h *watchHealth) runCtx() context.Context {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.run == nil {
		return context.Background()
	}
	return h.run
}

type failure struct {
	since time.Time
	err   error
}

// eventCounts are what one informer received: the list responses' items and
// the watch events, bookmarks apart. The scale test reads them; the agent
// exports them as metrics.
type eventCounts struct {
	Lists, Listed, Events, Bookmarks atomic.Uint64
}

// WatchStats are the totals of one informer's calls.
type WatchStats struct {
	// Lists is the number of list calls that returned, Listed the items
	// they returned.
	Lists, Listed uint64
	// Events is the number of watch events received (added, modified,
	// deleted), Bookmarks the bookmarks.
	Events, Bookmarks uint64
}

func newWatchHealth(log *slog.Logger, probe func(context.Context) error, interval time.Duration, changed func()) *watchHealth {
	return &watchHealth{
		log: log, probe: probe, interval: interval, changed: changed,
		failing: make(map[string]failure),
		wake:    make(chan struct{}),
	}
}

// state is when the informers last confirmed what they hold (now when
// every call of theirs works, else the first failure's time), and the
// error of the oldest failure.
func (h *watchHealth) state(now time.Time) (time.Time, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	at, err := now, error(nil)
	for _, f := range h.failing {
		if f.since.Before(at) {
			at, err = f.since, f.err
		}
	}
	return at, err
}

func (h *watchHealth) ok(name string) {
	h.mu.Lock()
	_, was := h.failing[name]
	delete(h.failing, name)
	recovered := was && len(h.failing) == 0
	h.mu.Unlock()
	if recovered {
		h.log.Info("API server reachable again: the watches are current")
		h.changed()
	}
}

func (h *watchHealth) fail(ctx context.Context, name string, err error) {
	if ctx.Err() != nil {
		return // stopping, or an informer replaced on purpose
	}
	h.mu.Lock()
	first := len(h.failing) == 0
	if _, ok := h.failing[name]; !ok {
		h.failing[name] = failure{since: time.Now(), err: err}
	}
	startProbe := false
	if notAnswering(err) && !h.down {
		h.down = true
		h.wake = make(chan struct{})
		startProbe = !h.probing
		h.probing = true
	}
	h.mu.Unlock()
	if first {
		h.log.Warn("watch failed; the last observed counts stand", "informer", name, "error", err)
		h.changed()
	}
	if startProbe {
		go h.probeUntilBack(h.runCtx())
	}
}

// probeUntilBack asks the API server every interval until it answers, then
// lets the held calls go.
func (h *watchHealth) probeUntilBack(ctx context.Context) {
	t := time.NewTicker(h.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			h.mu.Lock()
			h.probing = false
			h.mu.Unlock()
			return
		case <-t.C:
		}
		pctx, cancel := context.WithTimeout(ctx, h.interval)
		err := h.probe(pctx)
		cancel()
		if notAnswering(err) {
			continue
		}
		h.mu.Lock()
		h.down, h.probing = false, false
		close(h.wake)
		h.mu.Unlock()
		return
	}
}

// wait returns at once unless the API server was found not answering, then
// when it answers again or ctx ends.
func (h *watchHealth) wait(ctx context.Context) error {
	h.mu.Lock()
	down, wake := h.down, h.wake
	h.mu.Unlock()
	if !down {
		return nil
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-wake:
		return nil
	}
}

func (h *watchHealth) counts(name string) *eventCounts {
	c, _ := h.events.LoadOrStore(name, new(eventCounts))
	return c.(*eventCounts)
}

// stats returns the totals of every informer so far.
func (h *watchHealth) stats() map[string]WatchStats {
	out := make(map[string]WatchStats)
	h.events.Range(func(k, v any) bool {
		c := v.(*eventCounts)
		out[k.(string)] = WatchStats{Lists: c.Lists.Load(), Listed: c.Listed.Load(), Events: c.Events.Load(), Bookmarks: c.Bookmarks.Load()}
		return true
	})
	return out
}

// listWatch is the informer's ListerWatcher for one resource: its calls wait
// while the API server does not answer, their results date the informer's
// health, and its watch events are counted.
func (h *watchHealth) listWatch(name string,
	list func(context.Context, metav1.ListOptions) (runtime.Object, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error),
	tweak func(*metav1.ListOptions),
) *cache.ListWatch {
	counts := h.counts(name)
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			if err := h.wait(ctx); err != nil {
				return nil, err
			}
			if tweak != nil {
				tweak(&o)
			}
			obj, err := list(ctx, o)
			if err != nil {
				h.fail(ctx, name, err)
				return nil, err
			}
			counts.Lists.Add(1)
			counts.Listed.Add(uint64(meta.LenList(obj)))
			h.ok(name)
			return obj, nil
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			if err := h.wait(ctx); err != nil {
				return nil, err
			}
			if tweak != nil {
				tweak(&o)
			}
			w, err := watchFn(ctx, o)
			if err != nil {
				h.fail(ctx, name, err)
				return nil, err
			}
			h.ok(name)
			return &countingWatch{Interface: w, ctx: ctx, name: name, h: h, counts: counts, stop: make(chan struct{})}, nil
		},
	}
}

// countingWatch passes a watch's events on, counting them; an error event
// other than an expired resource version (after which the reflector
// relists) marks the informer failing.
type countingWatch struct {
	watch.Interface
	ctx    context.Context
	name   string
	h      *watchHealth
	counts *eventCounts
	once   sync.Once
	out    chan watch.Event
	stop   chan struct{}
	stopMu sync.Once
}

func (w *countingWatch) Stop() {
	w.stopMu.Do(func() { close(w.stop) })
	w.Interface.Stop()
}

func (w *countingWatch) ResultChan() <-chan watch.Event {
	w.once.Do(func() {
		w.out = make(chan watch.Event)
		go func() {
			defer close(w.out)
			for ev := range w.Interface.ResultChan() {
				switch ev.Type {
				case watch.Bookmark:
					w.counts.Bookmarks.Add(1)
				case watch.Error:
					if err := apierrors.FromObject(ev.Object); !apierrors.IsResourceExpired(err) && !apierrors.IsGone(err) {
						w.h.fail(w.ctx, w.name, err)
					}
				default:
					w.counts.Events.Add(1)
				}
				select {
				case w.out <- ev:
				case <-w.stop:
					return
				case <-w.ctx.Done():
					return
				}
			}
		}()
	})
	return w.out
}

// notAnswering reports whether an error means that the API server is not
// there or not ready (no answer, or a 5xx). An answer that refuses the call
// (401, 403, 404) shows it is there: holding the informers on it would stop
// them for good.
func notAnswering(err error) bool {
	var st apierrors.APIStatus
	if errors.As(err, &st) {
		return st.Status().Code >= 500
	}
	return err != nil
}
