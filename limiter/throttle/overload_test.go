package throttle

import (
	"context"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/nettest"
)

// overloadServer accepts up to rate requests a second (a token bucket of
// burst), answers 429 beyond, until recovered: then it accepts everything.
type overloadServer struct {
	start     time.Time
	recovered atomic.Bool

	mu     sync.Mutex
	tokens float64
	last   time.Time
	rate   float64
	burst  float64

	reached, accepted []atomic.Int64 // per slot
}

func (s *overloadServer) admit(now time.Time) bool {
	if s.recovered.Load() {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tokens = min(s.burst, s.tokens+now.Sub(s.last).Seconds()*s.rate)
	s.last = now
	if s.tokens < 1 {
		return false
	}
	s.tokens--
	return true
}

func (s *overloadServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	now := time.Now()
	i := slotOf(now.Sub(s.start), len(s.reached))
	s.reached[i].Add(1)
	if !s.admit(now) {
		w.WriteHeader(http.StatusTooManyRequests)
		return
	}
	s.accepted[i].Add(1)
	io.WriteString(w, "ok")
}

// slot is the resolution of the test's time series.
const slot = 100 * time.Millisecond

func slotOf(d time.Duration, n int) int { return min(n-1, max(0, int(d/slot))) }

func sum(a []atomic.Int64, from, to time.Duration) int64 {
	var n int64
	for i := slotOf(from, len(a)); i < slotOf(to, len(a)); i++ {
		n += a[i].Load()
	}
	return n
}

// TestOverloadAndRecovery is the throttle against a real HTTP server on
// loopback: the server accepts 100 req/s, the client offers 1,000 req/s.
//
//   - With the throttle, what reaches the server falls to about K×accepts
//     (the book's fixed point: the throttle lets through
//     requests×(K×accepts+1)/(requests+1) < K×accepts + 1 a window).
//   - When the server recovers, what reaches it rises back to what is
//     offered within 5 s (the refusals leave the 2 s window, and the new
//     accepts drive the probability down sooner).
func TestOverloadAndRecovery(t *testing.T) {
	if testing.Short() {
		t.Skip("11 s of real traffic")
	}
	nettest.HoldTraffic(t) // its rates are measured: alone, not beside another package's traffic
	const (
		k         = 2.0
		window    = 2 * time.Second
		offerRate = 1000 // requests a second
		overload  = 6 * time.Second
		recovery  = 5 * time.Second
		workers   = 32
	)
	total := overload + recovery
	slots := int(total/slot) + 1
	srv := &overloadServer{
		rate: 100, burst: 10, tokens: 10,
		reached:  make([]atomic.Int64, slots),
		accepted: make([]atomic.Int64, slots),
	}
	ts := httptest.NewServer(srv) // 127.0.0.1
	defer ts.Close()

	th := mustNew(t, Options{K: k, Window: window})
	base := &http.Transport{MaxIdleConns: workers, MaxIdleConnsPerHost: workers}
	defer base.CloseIdleConnections()
	client := &http.Client{Transport: &Transport{Throttle: th, Base: base}, Timeout: 10 * time.Second}

	offered := make([]atomic.Int64, slots)
	var refused, skipped, failed atomic.Int64
	jobs := make(chan struct{}, 4*workers)
	start := time.Now()
	srv.start, srv.last = start, start

	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range jobs {
				offered[slotOf(time.Since(start), slots)].Add(1)
				resp, err := client.Get(ts.URL)
				switch {
				case errors.Is(err, ErrThrottled):
					refused.Add(1)
				case err != nil:
					failed.Add(1)
					t.Errorf("request: %v", err)
				default:
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
		})
	}

	// The pacer: 1,000 requests a second on an absolute schedule, for
	// total, then it stops. A request the workers cannot take at once is
	// skipped (counted), not queued: the offered load is what was sent.
	ctx, cancel := context.WithTimeout(context.Background(), total+5*time.Second)
	defer cancel()
	sent := 0
	for sent < int(total.Seconds()*offerRate) && ctx.Err() == nil {
		el := time.Since(start)
		if el >= overload && !srv.recovered.Load() {
			srv.recovered.Store(true)
		}
		due := min(int(el.Seconds()*offerRate), int(total.Seconds()*offerRate))
		for ; sent < due; sent++ {
			select {
			case jobs <- struct{}{}:
			default:
				skipped.Add(1)
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	close(jobs)
	wg.Wait()

	// Steady overload: from one window after the start to the recovery.
	from, to := window+500*time.Millisecond, overload
	o, r, a := sum(offered, from, to), sum(srv.reached, from, to), sum(srv.accepted, from, to)
	// The margin: the throttle's refusals are independent draws, so what
	// reaches the server is a sum of Bernoulli trials, one per offered
	// request; its standard deviation is at most sqrt(o/4). Four of them,
	// plus K for the "+1" of the formula's denominator.
	margin := 4*math.Sqrt(float64(o)/4) + k
	t.Logf("overload %v-%v: offered %d, reached the server %d, accepted %d, K×accepts %.0f, margin %.0f (refused locally %d in all, skipped by the pacer %d)",
		from, to, o, r, a, k*float64(a), margin, refused.Load(), skipped.Load())
	if float64(r) > k*float64(a)+margin {
		t.Errorf("reached the server %d > K×accepts %.0f + margin %.0f", r, k*float64(a), margin)
	}
	if r > o/2 {
		t.Errorf("reached the server %d of %d offered: the throttle did not throttle", r, o)
	}
	if a == 0 {
		t.Error("the server accepted nothing")
	}

	// Recovery: the first slot from which, on two consecutive slots, at
	// least 90% of what is offered reaches the server.
	var recovered time.Duration = -1
	for i := slotOf(overload, slots); i+1 < slotOf(total, slots); i++ {
		ok := func(i int) bool {
			o := offered[i].Load()
			return o > 0 && float64(srv.reached[i].Load()) >= 0.9*float64(o)
		}
		if ok(i) && ok(i+1) {
			recovered = time.Duration(i+1)*slot - overload // the end of the first good slot
			break
		}
	}
	ro, rr := sum(offered, total-time.Second, total), sum(srv.reached, total-time.Second, total)
	t.Logf("recovery: reached at least 90%% of offered %v after the server recovered; last second: offered %d, reached %d", recovered, ro, rr)
	if recovered < 0 || recovered > recovery {
		t.Errorf("what reaches the server did not rise back within %v of the recovery", recovery)
	}
}
