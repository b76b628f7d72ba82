package agent

import (
	"testing"

	"github.com/rlagent/rlagent/watcher"
)

func TestDivide(t *testing.T) {
	for _, tt := range []struct {
		name        string
		rate, burst uint64
		service     bool
		obs         watcher.Observation
		want        Share
		warn        bool
	}{
		{"design example", 100_000, 10_000, false, watcher.Observation{Replicas: 10}, Share{Rate: 10_000, Burst: 1_000, Divisor: 10}, false},
		{"one replica", 20_000, 2_000, false, watcher.Observation{Replicas: 1}, Share{Rate: 20_000, Burst: 2_000, Divisor: 1}, false},
		{"four", 20_000, 2_000, false, watcher.Observation{Replicas: 4}, Share{Rate: 5_000, Burst: 500, Divisor: 4}, false},
		{"zero count is one", 20_000, 2_000, false, watcher.Observation{Replicas: 0}, Share{Rate: 20_000, Burst: 2_000, Divisor: 1}, true},
		{"burst floor 1", 1_000, 5, false, watcher.Observation{Replicas: 10}, Share{Rate: 100, Burst: 1, Divisor: 10}, false},
		{"share below 1/s", 5, 1, false, watcher.Observation{Replicas: 10}, Share{Rate: 1, Burst: 1, Divisor: 10}, true},
		{"service weighted", 90_000, 9_000, true, watcher.Observation{Replicas: 6, Local: 2}, Share{Rate: 30_000, Burst: 3_000, Divisor: 6, Local: 2}, false},
		{"service no local endpoint", 90_000, 9_000, true, watcher.Observation{Replicas: 6, Local: 0}, Share{Divisor: 6}, false},
		{"service no endpoint at all", 90_000, 9_000, true, watcher.Observation{}, Share{}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := divide(tt.rate, tt.burst, tt.service, tt.obs)
			if (got.Warning != "") != tt.warn {
				t.Errorf("warning %q, want one: %v", got.Warning, tt.warn)
			}
			got.Warning = ""
			if got != tt.want {
				t.Errorf("divide = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// The shares of all nodes of a service add up to the global rate.
func TestServiceSharesSum(t *testing.T) {
	const rate = 100_000
	placements := [][]int{{1, 1, 1}, {3, 0, 1}, {2, 2, 2}, {5, 1}, {1, 0, 0, 0, 7}}
	for _, p := range placements {
		total := 0
		for _, n := range p {
			total += n
		}
		var sum uint64
		for _, local := range p {
			sum += divide(rate, rate/10, true, watcher.Observation{Replicas: total, Local: local}).Rate
		}
		// Integer division loses at most one unit per node.
		if sum > rate || rate-sum >= uint64(len(p)) {
			t.Errorf("placement %v: shares sum to %d, want %d (less at most %d)", p, sum, rate, len(p)-1)
		}
	}
}
