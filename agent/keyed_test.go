package agent

import (
	"math"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/rlagent/rlagent/maps"
)

// Keyed demand shares, this node's part, without a data path: the plan's
// key shares, the key format's round trip, and the report built from hot
// keys and the keys' use of their shares.

// TestPlanKeyShares: a keyed limit with share demand records hot keys and
// gives each followed key its own share, its burst scaled as a node's is;
// a key the data path cannot hold (not one of the limit's) is left out;
// share equal, or key none, has neither.
func TestPlanKeyShares(t *testing.T) {
	keyed := limit(t, "per-source", "{rate: 3000, burst: 300, scope: nodes, share: demand, key: src-ip, match: {protocol: udp}}")
	in := counted(3, keyed)
	in.keyShares = map[string]map[string]uint64{"per-source": {
		"10.203.0.1":  2980,
		"2001:db8::1": 10,
		"10.0.0.0/24": 500, // a network: not a src-ip key
		"udp/53":      500,
	}}
	d := mustPlan(t, in, "per-source")
	if !d.limit.Hot {
		t.Errorf("a keyed limit with share demand: Hot false, want hot keys recorded")
	}
	if d.limit.Rate != 1000 {
		t.Errorf("the limit's own share %d, want the equal share 1000 (every key without one of its own)", d.limit.Rate)
	}
	want := map[maps.Bucket]maps.KeyShare{
		{Addr: netip.MustParseAddr("10.203.0.1")}:  {Rate: 2980, Burst: 298},
		{Addr: netip.MustParseAddr("2001:db8::1")}: {Rate: 10, Burst: 1},
	}
	if !reflect.DeepEqual(d.keyShares, want) {
		t.Errorf("key shares %v, want %v", d.keyShares, want)
	}

	for _, spec := range []string{
		"{rate: 3000, scope: nodes, share: equal, key: src-ip}",
		"{rate: 3000, scope: nodes, share: demand}",
	} {
		l := limit(t, "other", spec)
		in := counted(3, l)
		in.keyShares = map[string]map[string]uint64{"other": {"10.203.0.1": 2980}}
		if d := mustPlan(t, in, "other"); d.limit.Hot || d.keyShares != nil {
			t.Errorf("%s: hot %v, key shares %v; want neither", spec, d.limit.Hot, d.keyShares)
		}
	}
}

// TestKeyFormat: every key kind's bucket goes to the key format and back,
// and a key of another kind is refused.
func TestKeyFormat(t *testing.T) {
	for _, tc := range []struct {
		spec, key string
		bucket    maps.Bucket
	}{
		{"{rate: 10, key: src-ip}", "192.0.2.1", maps.Bucket{Addr: netip.MustParseAddr("192.0.2.1")}},
		{"{rate: 10, key: dst-ip}", "2001:db8::7", maps.Bucket{Addr: netip.MustParseAddr("2001:db8::7")}},
		{"{rate: 10, key: src-prefix}", "192.0.2.0/24", maps.Bucket{Addr: netip.MustParseAddr("192.0.2.0"), Prefix: 24}},
		{"{rate: 10, key: dst-prefix, prefixLength: {ipv6: 48}}", "2001:db8:1::/48", maps.Bucket{Addr: netip.MustParseAddr("2001:db8:1::"), Prefix: 48}},
		{"{rate: 10, key: dst-port}", "tcp/443", maps.Bucket{Protocol: maps.TCP, Port: 443}},
		{"{rate: 10, key: dst-port}", "icmp/0", maps.Bucket{Protocol: maps.ICMP}},
		{"{rate: 10, key: dst-port}", "any/0", maps.Bucket{Protocol: maps.AnyProtocol}},
	} {
		l := limit(t, "k", tc.spec)
		b, err := bucketOfKey(&l.RateLimitSpec, tc.key)
		if err != nil || b != tc.bucket {
			t.Errorf("%s: bucketOfKey(%q) = %+v, %v; want %+v", tc.spec, tc.key, b, err, tc.bucket)
		}
		if got := keyOfBucket(tc.bucket); got != tc.key {
			t.Errorf("%s: keyOfBucket(%+v) = %q, want %q", tc.spec, tc.bucket, got, tc.key)
		}
	}
	l := limit(t, "k", "{rate: 10, key: src-ip}")
	if b, err := bucketOfKey(&l.RateLimitSpec, "tcp/443"); err == nil {
		t.Errorf("bucketOfKey(src-ip, tcp/443) = %+v, want an error", b)
	}
}

// TestHotDemands: what a node reports of a keyed limit's keys. A key short
// of tokens asks for its share and what it turned away per second; one no
// longer short asks for what it takes of its own share until it cools an
// interval later; one that takes more than the floor of a share of its
// own stays; at most n keys, those asking the most; and a key that cooled
// is forgotten.
func TestHotDemands(t *testing.T) {
	const tick = 250 * time.Millisecond
	now := time.Unix(1000, 0)
	st := &demandState{equal: 1000, floor: 10,
		shares: map[string]uint64{"10.0.0.2": 2980, "10.0.0.3": 1500, "10.0.0.4": 10},
		hot: map[string]*hotKey{
			"10.0.0.1": {tick: 9, short: [2]uint64{250, 200}, seen: now},                       // short now, at the equal share
			"10.0.0.2": {tick: 9, short: [2]uint64{100, 0}, seen: now.Add(-time.Second)},       // not short any more
			"10.0.0.5": {tick: 3, short: [2]uint64{500, 500}, seen: now.Add(-3 * time.Second)}, // cooled
		},
		use: map[string]*keyUse{
			"10.0.0.2": {rate: 2000, rated: true},
			"10.0.0.3": {rate: 1200, rated: true}, // not hot, takes more than the floor
			"10.0.0.4": {rate: 9, rated: true},    // at the floor
		},
	}
	got := st.hotDemands(8, now, 2*time.Second, 2*tick, tick)
	want := map[string]float64{"10.0.0.1": 1000 + 250/tick.Seconds(), "10.0.0.2": 2000, "10.0.0.3": 1200}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("hotDemands = %v, want %v", got, want)
	}
	if _, ok := st.hot["10.0.0.5"]; ok {
		t.Errorf("the cooled key is still held")
	}
	if got := st.hotDemands(2, now, 2*time.Second, 2*tick, tick); len(got) != 2 || got["10.0.0.3"] != 0 {
		t.Errorf("hotDemands with n = 2: %v, want the 2 asking the most (10.0.0.1 and 10.0.0.2)", got)
	}
	// 5 s later every record is old: the keys that take more than the
	// floor of a share of their own stay, with what they take.
	if got, want := st.hotDemands(8, now.Add(5*time.Second), 2*time.Second, 2*tick, tick), map[string]float64{"10.0.0.2": 2000, "10.0.0.3": 1200}; !reflect.DeepEqual(got, want) {
		t.Errorf("5 s later: %v, want %v", got, want)
	}
	if len(st.hot) != 0 {
		t.Errorf("5 s later, hot keys held: %v, want none", st.hot)
	}
	if d := (&hotKey{short: [2]uint64{math.MaxUint32, 0}}).demand(5, tick); d <= 5 {
		t.Errorf("demand of a key short by 2^32 units: %v", d)
	}
}
