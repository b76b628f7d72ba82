package divide

import "testing"

func TestEvenly(t *testing.T) {
	for _, tt := range []struct {
		name        string
		rate, burst uint64
		replicas    int
		want        Share
		warn        bool
	}{
		{"design example", 100_000, 10_000, 10, Share{Rate: 10_000, Burst: 1_000, Divisor: 10}, false},
		{"one replica", 20_000, 2_000, 1, Share{Rate: 20_000, Burst: 2_000, Divisor: 1}, false},
		{"four", 20_000, 2_000, 4, Share{Rate: 5_000, Burst: 500, Divisor: 4}, false},
		{"zero count is one", 20_000, 2_000, 0, Share{Rate: 20_000, Burst: 2_000, Divisor: 1}, true},
		{"negative count is one", 20_000, 2_000, -3, Share{Rate: 20_000, Burst: 2_000, Divisor: 1}, true},
		{"burst floor 1", 1_000, 5, 10, Share{Rate: 100, Burst: 1, Divisor: 10}, false},
		{"share below 1/s", 5, 1, 10, Share{Rate: 1, Burst: 1, Divisor: 10}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := Evenly(tt.rate, tt.burst, tt.replicas)
			if (got.Warning != "") != tt.warn {
				t.Errorf("warning %q, want one: %v", got.Warning, tt.warn)
			}
			got.Warning = ""
			if got != tt.want {
				t.Errorf("Evenly = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestByEndpoints(t *testing.T) {
	for _, tt := range []struct {
		name            string
		rate, burst     uint64
		local, replicas int
		want            Share
		warn            bool
	}{
		{"weighted", 90_000, 9_000, 2, 6, Share{Rate: 30_000, Burst: 3_000, Divisor: 6, Local: 2}, false},
		{"all local", 90_000, 9_000, 6, 6, Share{Rate: 90_000, Burst: 9_000, Divisor: 6, Local: 6}, false},
		{"more local than counted", 90_000, 9_000, 8, 6, Share{Rate: 90_000, Burst: 9_000, Divisor: 6, Local: 8}, false},
		{"no local endpoint", 90_000, 9_000, 0, 6, Share{Divisor: 6}, false},
		{"no endpoint at all", 90_000, 9_000, 0, 0, Share{}, false},
		{"local without a count", 90_000, 9_000, 2, 0, Share{}, false},
		{"share below 1/s", 5, 1, 1, 10, Share{Rate: 1, Burst: 1, Divisor: 10, Local: 1}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := ByEndpoints(tt.rate, tt.burst, tt.local, tt.replicas)
			if (got.Warning != "") != tt.warn {
				t.Errorf("warning %q, want one: %v", got.Warning, tt.warn)
			}
			got.Warning = ""
			if got != tt.want {
				t.Errorf("ByEndpoints = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// The shares of all nodes of a service add up to the global rate.
func TestByEndpointsSum(t *testing.T) {
	const rate = 100_000
	placements := [][]int{{1, 1, 1}, {3, 0, 1}, {2, 2, 2}, {5, 1}, {1, 0, 0, 0, 7}}
	for _, p := range placements {
		total := 0
		for _, n := range p {
			total += n
		}
		var sum uint64
		for _, local := range p {
			sum += ByEndpoints(rate, rate/10, local, total).Rate
		}
		// Integer division loses at most one unit per node.
		if sum > rate || rate-sum >= uint64(len(p)) {
			t.Errorf("placement %v: shares sum to %d, want %d (less at most %d)", p, sum, rate, len(p)-1)
		}
	}
}

func TestByDemand(t *testing.T) {
	equal := Evenly(100_000, 10_000, 4)
	for _, tt := range []struct {
		name              string
		rate, burst, node uint64
		wantRate, wantBur uint64
	}{
		{"a tenth", 100_000, 10_000, 10_000, 10_000, 1_000},
		{"all of it", 100_000, 10_000, 100_000, 100_000, 10_000},
		{"nothing is 1", 100_000, 10_000, 0, 1, 1},
		{"burst floor 1", 100_000, 5, 100, 100, 1},
		{"no overflow", 1 << 40, 3600 << 40, 1 << 39, 1 << 39, 1800 << 40},
		{"a global rate of 0", 0, 10, 5, 5, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := equal
			s.Warning = "replaced"
			got := ByDemand(s, tt.rate, tt.burst, tt.node)
			want := Share{Rate: tt.wantRate, Burst: tt.wantBur, Divisor: equal.Divisor, Local: equal.Local}
			if got != want {
				t.Errorf("ByDemand = %+v, want %+v", got, want)
			}
		})
	}
}
