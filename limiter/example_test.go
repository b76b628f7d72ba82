package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rlagent/rlagent/limiter"
)

// A limiter with limits set by hand: 100 requests per second per client
// with bursts of 2, and a key-less limit on the whole API.
func Example() {
	l, err := limiter.New(limiter.Options{})
	if err != nil {
		panic(err)
	}
	err = l.Apply([]limiter.LimitConfig{
		{Name: "per-client", Rate: 100, Burst: 2, Keyed: true},
		{Name: "api", Rate: 1000, Burst: 100},
	})
	if err != nil {
		panic(err)
	}
	s := l.Set("per-client", "api") // once; for every request
	for i := range 3 {
		fmt.Println(i, s.Allow("203.0.113.7")) // keys: per-client's, and api ignores its
	}
	fmt.Println("another client:", s.Allow("198.51.100.1"))
	// Output:
	// 0 true
	// 1 true
	// 2 false
	// another client: true
}

// Wait follows each limit's policy: a limit that waits holds the caller
// until its token accrues, up to MaxWait; one that fails refuses at once.
func ExampleSet_Wait() {
	l, _ := limiter.New(limiter.Options{})
	l.Apply([]limiter.LimitConfig{
		{Name: "paced", Rate: 20, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: time.Second},
		{Name: "strict", Rate: 0.001, Burst: 1},
	})
	paced := l.Set("paced")
	start := time.Now()
	for range 3 {
		if err := paced.Wait(context.Background()); err != nil {
			panic(err)
		}
	}
	fmt.Println("3 waits at 20/s took at least 100ms:", time.Since(start) >= 95*time.Millisecond)

	strict := l.Set("strict")
	strict.Wait(context.Background())
	err := strict.Wait(context.Background())
	var rej *limiter.RejectedError
	fmt.Println(errors.Is(err, limiter.ErrLimited), errors.As(err, &rej) && rej.Limit == "strict")
	// Output:
	// 3 waits at 20/s took at least 100ms: true
	// true true
}

// Reserve takes the tokens now and says how long to wait before acting;
// Cancel gives them back.
func ExampleSet_Reserve() {
	l, _ := limiter.New(limiter.Options{})
	l.Apply([]limiter.LimitConfig{{Name: "jobs", Rate: 10, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: time.Minute}})
	s := l.Set("jobs")
	first, second := s.Reserve(), s.Reserve()
	fmt.Println(first.OK(), first.Delay() == 0)
	fmt.Println(second.OK(), second.Delay() > 50*time.Millisecond)
	second.Cancel()
	// Output:
	// true true
	// true true
}

// Status is what response headers report: each limit's quota, and what
// is left to this key.
func ExampleSet_Status() {
	l, _ := limiter.New(limiter.Options{})
	l.Apply([]limiter.LimitConfig{{Name: "per-client", Rate: 1, Burst: 5, Keyed: true}})
	s := l.Set("per-client")
	s.AllowN(2, "203.0.113.7")
	st := s.Status(nil, "203.0.113.7")[0]
	fmt.Println(st.Limit, st.Quota, st.Remaining)
	// Output: per-client 5 3
}

// New with every option at its zero value but metrics: limits come from
// Apply, keyed limits hold up to 100,000 keys, logs go to slog.Default.
func ExampleNew() {
	reg := prometheus.NewRegistry()
	l, err := limiter.New(limiter.Options{Registerer: reg})
	if err != nil {
		panic(err)
	}
	l.Apply([]limiter.LimitConfig{{Name: "api", Rate: 100, Burst: 10}})
	l.Set("api").Allow()
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == "rlagent_limiter_admitted_total" {
			fmt.Println(mf.GetName(), mf.GetMetric()[0].GetCounter().GetValue())
		}
	}
	// Output: rlagent_limiter_admitted_total 1
}

// Apply replaces every limit at once; a config that is not valid is
// refused whole, naming the field, and the limits stay as they were.
func ExampleLimiter_Apply() {
	l, _ := limiter.New(limiter.Options{})
	l.Apply([]limiter.LimitConfig{{Name: "api", Rate: 100, Burst: 10}})
	err := l.Apply([]limiter.LimitConfig{{Name: "api", Rate: 100, Burst: 0}})
	fmt.Println(err)
	c, _ := l.Config("api")
	fmt.Println(c.Burst)
	// Output:
	// limiter: limits[0] (api).Burst: 0 is not at least 1
	// 10
}

// A Set follows its names: a limit not configured yet admits, and is
// enforced from the moment Apply defines it.
func ExampleLimiter_Set() {
	l, _ := limiter.New(limiter.Options{})
	s := l.Set("later")
	fmt.Println(s.Allow(), s.Allow())
	l.Apply([]limiter.LimitConfig{{Name: "later", Rate: 1, Burst: 1}})
	fmt.Println(s.Allow(), s.Allow())
	// Output:
	// true true
	// true false
}

// AllowN draws several tokens at once, from every limit or from none.
func ExampleSet_AllowN() {
	l, _ := limiter.New(limiter.Options{})
	l.Apply([]limiter.LimitConfig{
		{Name: "per-user", Rate: 1, Burst: 10, Keyed: true},
		{Name: "api", Rate: 1, Burst: 15},
	})
	s := l.Set("per-user", "api")
	fmt.Println(s.AllowN(10, "alice")) // alice's whole burst
	fmt.Println(s.AllowN(10, "bob"))   // bob has 10, api only 5 left: nothing drawn
	fmt.Println(s.AllowN(5, "bob"))
	// Output:
	// true
	// false
	// true
}
