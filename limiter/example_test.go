package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"time"

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
