package demand

import (
	"math"
	"testing"
	"time"
)

func TestMeter(t *testing.T) {
	m := Meter{Tau: 3 * time.Second}
	t0 := time.Unix(1000, 0)
	var count uint64
	at := t0
	step := func(rate uint64, d time.Duration) float64 {
		var got float64
		for e := time.Duration(0); e < d; e += time.Second {
			count += rate
			at = at.Add(time.Second)
			got = m.Observe(count, at)
		}
		return got
	}
	m.Observe(0, t0)
	if _, ok := m.Demand(); ok {
		t.Fatal("warm before one interval")
	}
	if got := step(7000, time.Second); got != 7000 {
		t.Fatalf("first interval: %v, want 7000", got)
	}
	if got := step(7000, 20*time.Second); got != 7000 {
		t.Fatalf("steady: %v, want 7000", got)
	}
	if !m.Settled(0.1) {
		t.Error("a steady demand is not settled")
	}
	// A step down to 3000: 63% of the way after Tau, 95% after 3 Tau; not
	// settled (within 10%) until about 2.5 Tau.
	if got := step(3000, 3*time.Second); math.Abs(got-(7000-0.632*4000)) > 40 || m.Settled(0.1) {
		t.Errorf("Tau after a step to 3000: %v settled %v, want ~%v, not settled", got, m.Settled(0.1), 7000-0.632*4000)
	}
	if got := step(3000, 6*time.Second); math.Abs(got-(7000-0.95*4000)) > 40 || !m.Settled(0.1) {
		t.Errorf("3 Tau after the step: %v settled %v, want ~%v, settled", got, m.Settled(0.1), 7000-0.95*4000)
	}
	// The interval's length counts, not the number of samples: one
	// sample after 3 s moves it as far as three after 1 s each.
	a, b := Meter{Tau: 3 * time.Second}, Meter{Tau: 3 * time.Second}
	a.Observe(0, t0)
	b.Observe(0, t0)
	a.Observe(1000, t0.Add(time.Second))
	b.Observe(1000, t0.Add(time.Second))
	a.Observe(4000, t0.Add(2*time.Second))
	a.Observe(7000, t0.Add(3*time.Second))
	a.Observe(10000, t0.Add(4*time.Second))
	b.Observe(10000, t0.Add(4*time.Second))
	ra, _ := a.Demand()
	rb, _ := b.Demand()
	if math.Abs(ra-rb)/ra > 0.06 {
		t.Errorf("three samples give %v, one sample over the same time %v", ra, rb)
	}
	// A counter that goes back (the limit installed again) starts over.
	got := m.Observe(5, at.Add(time.Second))
	if _, ok := m.Demand(); ok || got == 0 {
		t.Errorf("after a reset: %v warm %v, want the old estimate kept, not warm", got, ok)
	}
	if got := m.Observe(505, at.Add(2*time.Second)); got != 500 {
		t.Errorf("first interval after the reset: %v, want 500", got)
	}
	// The same instant twice adds nothing.
	if got := m.Observe(10_000, at.Add(2*time.Second)); got != 500 {
		t.Errorf("a sample at the same instant: %v, want 500", got)
	}
}

func TestMoved(t *testing.T) {
	for _, tc := range []struct {
		reported, demand float64
		want             bool
	}{
		{7000, 7100, false}, // 1.4%: jitter
		{7000, 8000, true},  // 12.5%
		{7000, 6000, true},
		{0, 20, false},  // below abs
		{0, 200, true},  // idle to busy
		{3000, 0, true}, // busy to idle
		{10, 15, false}, // 33% but 5 units/s
		{1e6, 1.05e6, false},
	} {
		if got := Moved(tc.reported, tc.demand, 0.1, 50); got != tc.want {
			t.Errorf("Moved(%v, %v) = %v, want %v", tc.reported, tc.demand, got, tc.want)
		}
	}
}
