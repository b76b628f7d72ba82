package limiter

import (
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/time/rate"
)

// The benchmarks time the limiter and its reference in the same run, in
// turns, and report the ratio (x-rate: to golang.org/x/time/rate's
// Limiter.Allow; x-map: to a plain Go map lookup of the same keys): these
// machines are shared and noisy, and not all the same CPU, so a ratio
// measured side by side is the figure to compare, not a time.
//
//	go test -run '^$' -bench . -count 6 ./limiter/

// cpuModel is the CPU's model name, for the benchmark's log.
func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return runtime.GOARCH
	}
	for _, line := range strings.Split(string(b), "\n") {
		if name, ok := strings.CutPrefix(line, "model name"); ok {
			return strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(name), ":"))
		}
	}
	return runtime.GOARCH
}

var logOnce sync.Once

func logMachine(b *testing.B) {
	logOnce.Do(func() { b.Logf("CPU %s, GOMAXPROCS %d", cpuModel(), runtime.GOMAXPROCS(0)) })
}

// timeIt runs f n times on g goroutines (n/g each) and returns the time
// per call.
func timeIt(n, g int, f func()) float64 {
	var wg sync.WaitGroup
	start := time.Now()
	for range g {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range n / g {
				f()
			}
		}()
	}
	wg.Wait()
	return float64(time.Since(start).Nanoseconds()) / float64(n/g*g)
}

// pair times ours and ref in turns, round by round, and reports ours'
// ns/call and the ratio of the sums.
func pair(b *testing.B, g int, metric string, ours, ref func()) {
	logMachine(b)
	const rounds = 5
	n := max(b.N, 1000)
	var o, r float64
	b.ResetTimer()
	for range rounds {
		o += timeIt(n/rounds, g, ours)
		r += timeIt(n/rounds, g, ref)
	}
	b.StopTimer()
	b.ReportMetric(o/rounds, "ns/op") // ours, per call
	b.ReportMetric(r/rounds, "ref-ns/op")
	b.ReportMetric(o/r, metric)
}

// BenchmarkAllow: one key-less limit, against x/time/rate's Allow, on one
// goroutine (the target: at most 1.0x) and on GOMAXPROCS goroutines (the
// target: at most 0.25x: x/time/rate serialises on one mutex, ours draws
// from a shard per processor). The rate is high enough that every call is
// admitted: the cost of the path every admitted request takes.
func BenchmarkAllow(b *testing.B) {
	for _, g := range []int{1, runtime.GOMAXPROCS(0)} {
		name := "goroutines=1"
		if g > 1 {
			name = "goroutines=gomaxprocs"
		}
		b.Run(name, func(b *testing.B) {
			l, err := New(Options{Logger: discard()})
			if err != nil {
				b.Fatal(err)
			}
			l.Apply([]LimitConfig{{Name: "a", Rate: 1e9, Burst: 1e9}})
			s := l.Set("a")
			ref := rate.NewLimiter(1e9, 1e9)
			pair(b, g, "x-rate", func() { s.Allow() }, func() { ref.Allow() })
		})
	}
}

// BenchmarkAllowKeyed: a keyed limit holding 1,000,000 keys, a key drawn
// at random per call (from a pre-built sequence), against a plain
// map[string]int64 lookup of the same keys in the same order (the
// target: at most 2.0x).
func BenchmarkAllowKeyed(b *testing.B) {
	const keys = 1_000_000
	ks := make([]string, keys)
	m := make(map[string]int64, keys)
	for i := range ks {
		ks[i] = "10." + strconv.Itoa(i>>16) + "." + strconv.Itoa(i>>8&255) + "." + strconv.Itoa(i&255)
		m[ks[i]] = int64(i)
	}
	l, err := New(Options{Logger: discard(), MaxKeys: 2 * keys})
	if err != nil {
		b.Fatal(err)
	}
	l.Apply([]LimitConfig{{Name: "k", Rate: 1e9, Burst: 1e9, Keyed: true}})
	s := l.Set("k")
	for _, k := range ks {
		s.Allow(k)
	}
	seq := make([]string, 1<<20)
	rnd := rand.New(rand.NewPCG(1, 2))
	for i := range seq {
		seq[i] = ks[rnd.IntN(keys)]
	}
	var i, j int
	var sink int64
	pair(b, 1, "x-map",
		func() { s.Allow(seq[i&(len(seq)-1)]); i++ },
		func() { sink += m[seq[j&(len(seq)-1)]]; j++ })
	_ = sink
}
