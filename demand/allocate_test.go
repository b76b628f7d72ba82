package demand

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestAllocate(t *testing.T) {
	const none = math.MaxUint64
	for _, tc := range []struct {
		name    string
		rate    uint64
		floor   uint64
		demands []uint64
		water   uint64
		shares  []uint64
	}{
		{"equal demand above the rate", 10_000, 100, []uint64{8000, 8000}, 5000, []uint64{5000, 5000}},
		{"equal demand below the rate", 10_000, 100, []uint64{3000, 3000}, none, []uint64{3000, 3000}},
		// The example: equal shares would admit 5,000 + 3,000.
		{"7:3 above the rate", 10_000, 100, []uint64{10_500, 4500}, 5500, []uint64{5500, 4500}},
		{"7:3:0", 10_000, 66, []uint64{7000, 3000, 0}, 6934, []uint64{6934, 3000, 66}},
		{"one idle node", 9000, 60, []uint64{9000, 9000, 0}, 4470, []uint64{4470, 4470, 60}},
		{"demand above the limit everywhere", 900, 0, []uint64{5000, 400, 1000}, 300, []uint64{300, 300, 300}},
		{"demand below the limit everywhere", 10_000, 50, []uint64{100, 2000, 10}, none, []uint64{100, 2000, 50}},
		{"floor 0, idle nodes get nothing", 10_000, 0, []uint64{20_000, 0, 0}, 10_000, []uint64{10_000, 0, 0}},
		{"floor above an even split is lowered", 100, 60, []uint64{0, 0}, none, []uint64{50, 50}},
		{"rounding leaves less than a unit a node", 10, 0, []uint64{9, 9, 9}, 3, []uint64{3, 3, 3}},
		{"one node", 1000, 20, []uint64{5000}, 1000, []uint64{1000}},
		{"no demand at all", 1000, 20, []uint64{0, 0, 0}, none, []uint64{20, 20, 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := Allocate(tc.rate, tc.floor, tc.demands)
			if l.Water != tc.water {
				t.Errorf("water %d, want %d", l.Water, tc.water)
			}
			var sum uint64
			for i, d := range tc.demands {
				s := l.Share(d)
				sum += s
				if s != tc.shares[i] {
					t.Errorf("node %d (demand %d): share %d, want %d", i, d, s, tc.shares[i])
				}
			}
			if sum > tc.rate {
				t.Errorf("shares sum to %d, above the rate %d", sum, tc.rate)
			}
		})
	}
}

// A node joining or leaving changes the demands of the next round: the
// shares of each round sum to at most the rate, the joiner's floor
// included once it is counted.
func TestAllocateJoinLeave(t *testing.T) {
	const rate, floor = 10_000, 60
	before := Allocate(rate, floor, []uint64{7000, 3000, 0})
	joined := Allocate(rate, floor, []uint64{7000, 3000, 0, 0})
	left := Allocate(rate, floor, []uint64{7000, 0})
	if got := before.Share(7000); got != 6940 {
		t.Errorf("before: busy node gets %d, want 6940", got)
	}
	if got := joined.Share(7000); got != 6880 {
		t.Errorf("after a node joined: busy node gets %d, want 6880 (a floor less)", got)
	}
	if got := left.Share(7000); got != 7000 {
		t.Errorf("after a node left: busy node gets %d, want all it asks for", got)
	}
}

// TestAllocateSum checks the invariant and max-min fairness on random
// demands: the shares sum to at most the rate; when a node is capped the
// sum falls short of the rate by less than a unit a node, and no node is
// capped below what an uncapped node gets.
func TestAllocateSum(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 20_000; i++ {
		n := 1 + r.IntN(50)
		rate := uint64(r.IntN(1_000_000))
		floor := uint64(0)
		if r.IntN(2) == 0 && n > 0 {
			floor = rate / uint64(n) * uint64(r.IntN(3)) / 100 // 0-2% of the equal share
		}
		d := make([]uint64, n)
		for j := range d {
			switch r.IntN(4) {
			case 0: // idle
			case 1:
				d[j] = uint64(r.IntN(int(rate) + 1))
			default:
				d[j] = uint64(r.IntN(2*int(rate)/n + 1))
			}
		}
		l := Allocate(rate, floor, d)
		var sum uint64
		capped := false
		for _, x := range d {
			s := l.Share(x)
			sum += s
			if s < max(x, floor) {
				capped = true
				if s != l.Water {
					t.Fatalf("rate %d floor %d demands %v: a capped node got %d, not the water level %d", rate, floor, d, s, l.Water)
				}
			}
			if s > max(x, floor) {
				t.Fatalf("rate %d floor %d demands %v: share %d above the demand and the floor", rate, floor, d, s)
			}
		}
		if sum > rate {
			t.Fatalf("rate %d floor %d demands %v: shares sum to %d", rate, floor, d, sum)
		}
		if capped && rate-sum >= uint64(n) {
			t.Fatalf("rate %d floor %d demands %v: %d left unallocated with a node capped", rate, floor, d, rate-sum)
		}
	}
}
