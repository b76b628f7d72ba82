package maps

import (
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/rlagent/rlagent/bpf"
)

// TestKeyShareLife: a key's share of its own is written, changed and
// removed; it is refused where it cannot work, whole (a bad key writes
// nothing); keys are masked to a prefix limit's prefix; and it goes with
// its limit. Program.Run checks what the data path does with them
// (bpf.TestKeyShares).
func TestKeyShareLife(t *testing.T) {
	d := loadTestClock(t)
	keyed := Limit{Rate: 1000, Burst: 100, Key: KeySrcPrefix, Prefix4: 24, Prefix6: 64}
	if err := d.SetLimit(1, keyed); err != nil {
		t.Fatal(err)
	}
	if err := d.SetLimit(2, Limit{Rate: 1000, Burst: 100}); err != nil {
		t.Fatal(err)
	}
	a := Bucket{Addr: netip.MustParseAddr("10.1.2.3")}
	b := Bucket{Addr: netip.MustParseAddr("2001:db8::1")}
	shares := func() map[Bucket]KeyShare {
		t.Helper()
		got, err := d.KeyShares(1)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}

	for _, tc := range []struct {
		name string
		id   uint32
		in   map[Bucket]KeyShare
		want string
	}{
		{"unknown limit", 9, map[Bucket]KeyShare{a: {1, 1}}, "unknown limit"},
		{"a limit without keys", 2, map[Bucket]KeyShare{a: {1, 1}}, "only a keyed limit"},
		{"a burst of 0", 1, map[Bucket]KeyShare{a: {10, 0}}, "burst"},
		{"no address", 1, map[Bucket]KeyShare{a: {10, 1}, {}: {10, 1}}, "no address"},
	} {
		err := d.SetKeyShares(tc.id, tc.in)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", tc.name, err, tc.want)
		}
	}
	if got := shares(); len(got) != 0 {
		t.Fatalf("refused writes left %v", got)
	}

	if err := d.SetKeyShares(1, map[Bucket]KeyShare{a: {5000, 500}, b: {200, 20}}); err != nil {
		t.Fatal(err)
	}
	// Masked to the limit's prefixes, as the data path keys them.
	a24 := Bucket{Addr: netip.MustParseAddr("10.1.2.0"), Prefix: 24}
	b64 := Bucket{Addr: netip.MustParseAddr("2001:db8::"), Prefix: 64}
	if got := shares(); len(got) != 2 || got[a24] != (KeyShare{5000, 500}) || got[b64] != (KeyShare{200, 20}) {
		t.Errorf("KeyShares = %v, want 10.1.2.0/24 and 2001:db8::/64", got)
	}
	epoch := d.limits[1].entry.OvEpoch
	if epoch == 0 {
		t.Errorf("override epoch 0 after a write")
	}
	// The same again: nothing written, the epoch stays.
	if err := d.SetKeyShares(1, map[Bucket]KeyShare{a: {5000, 500}, b: {200, 20}}); err != nil || d.limits[1].entry.OvEpoch != epoch {
		t.Errorf("an unchanged write: %v, epoch %d -> %d", err, epoch, d.limits[1].entry.OvEpoch)
	}
	// Changed and removed.
	if err := d.SetKeyShares(1, map[Bucket]KeyShare{a: {3000, 300}}); err != nil {
		t.Fatal(err)
	}
	if got := shares(); len(got) != 1 || got[a24] != (KeyShare{3000, 300}) || d.limits[1].entry.OvEpoch == epoch {
		t.Errorf("after a change and a removal: %v (epoch %d)", got, d.limits[1].entry.OvEpoch)
	}
	// A count change keeps them; the epoch is the limit entry's.
	keyed.Rate = 2000
	if err := d.SetLimit(1, keyed); err != nil {
		t.Fatal(err)
	}
	if got := shares(); len(got) != 1 {
		t.Errorf("after a count change: %v, want the key's share kept", got)
	}
	// Deleted with the limit.
	if err := d.DeleteLimit(1); err != nil {
		t.Fatal(err)
	}
	if _, err := d.KeyShares(1); !errors.Is(err, ErrUnknownLimit) {
		t.Errorf("KeyShares of a deleted limit: %v", err)
	}
	var (
		k  bpf.RatelimitRlBucketKey
		ov bpf.RatelimitRlOverride
	)
	for it := d.objs.RlOverrides.Iterate(); it.Next(&k, &ov); {
		t.Errorf("after its limit was deleted: a key share of limit %d is left", k.Limit)
	}
}
