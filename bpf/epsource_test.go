package bpf_test

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// The endpoint whose egress the tests below run: its interface is the one
// test_run hands the skb (testIfindex), its addresses one of each family;
// its neighbour is another pod of the same limits.
var (
	epAddr4, epAddr6       = netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("fd00::5")
	neighbour4, neighbour6 = "10.1.0.6", "fd00::6"
)

// endpointEgressLimit is a limit at the endpoints' egress keyed by source,
// for the pods of 10.1.0.0/24 and fd00::/64: each pod its own bucket of
// burst packets, none refilled (rate 1/s on a stopped clock).
func endpointEgressLimit(burst uint64) maps.Limit {
	return maps.Limit{Rate: 1, Burst: burst, Key: maps.KeySrcIP, Match: maps.Match{
		Attach: maps.Endpoints, Direction: maps.Egress, Protocol: maps.UDP,
		SrcCIDRs: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/24"), netip.MustParsePrefix("fd00::/64")},
	}}
}

// egressFrom is a UDP datagram from src to a remote service.
func egressFrom(src string) []byte {
	dst := "192.0.2.80"
	if netip.MustParseAddr(src).Is6() {
		dst = "2001:db8::80"
	}
	return pkt{src: src, dst: dst, proto: protoUDP, sport: 40000, dport: 8080}.bytes()
}

func srcMismatches(tb testing.TB, d *maps.Datapath) uint64 {
	tb.Helper()
	g, err := d.GlobalStats()
	if err != nil {
		tb.Fatal(err)
	}
	return g.EndpointSrcMismatch
}

// bucketAddrs are the keys of limit id's live buckets.
func bucketAddrs(tb testing.TB, d *maps.Datapath, id uint32) []netip.Addr {
	tb.Helper()
	bs, err := d.Buckets(id)
	if err != nil {
		tb.Fatal(err)
	}
	var out []netip.Addr
	for _, b := range bs {
		out = append(out, b.Addr)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

// TestEndpointSourceSpoofed (issue 22, item 4): at an endpoint's egress a
// packet is matched and keyed as the endpoint's, by the addresses behind
// its interface, not by the source the pod wrote. A pod that forges its
// source (CAP_NET_RAW) neither leaves its limit (on 54615ce a source
// outside the limit's srcCIDRs passed unlimited) nor draws on its
// neighbour's bucket (on 54615ce the neighbour's address was the
// neighbour's key); each such packet is counted, and with
// endpointSourceCheck drop dropped. IPv6 link-local sources (neighbour
// discovery) are charged as the endpoint's but neither counted nor dropped.
func TestEndpointSourceSpoofed(t *testing.T) {
	d := hookDatapath(t)
	out := prog{"tc_endpoint_out", maps.EndpointOut, true}
	ctx := skbCtx(t, map[string]uint32{"ifindex": testIfindex})
	run := func(src string) uint32 { return out.runSkb(t, d, egressFrom(src), ctx) }
	setSources := func(addrs ...netip.Addr) {
		t.Helper()
		if err := d.SetEndpointSources(map[int][]netip.Addr{testIfindex: addrs}); err != nil {
			t.Fatal(err)
		}
	}
	const id, burst = 3, 4
	setSources(epAddr4, epAddr6)

	cases := []struct {
		name     string
		src      string // what the pod writes
		mismatch bool   // counted
		charged  netip.Addr
	}{
		{"own IPv4 address", epAddr4.String(), false, epAddr4},
		{"own IPv6 address", epAddr6.String(), false, epAddr6},
		{"the neighbour's IPv4 address", neighbour4, true, epAddr4},
		{"the neighbour's IPv6 address", neighbour6, true, epAddr6},
		{"an address outside the limit", "198.51.100.7", true, epAddr4},
		{"an IPv6 address outside the limit", "2001:db8:dead::1", true, epAddr6},
		{"IPv6 link-local", "fe80::1", false, epAddr6},
		{"IPv6 unspecified", "::", false, epAddr6},
	}
	for _, check := range []maps.SourceCheck{maps.SourceCount, maps.SourceDrop} {
		if err := d.SetSourceCheck(check); err != nil {
			t.Fatal(err)
		}
		for _, tc := range cases {
			name := tc.name + "/count"
			if check == maps.SourceDrop {
				name = tc.name + "/drop"
			}
			t.Run(name, func(t *testing.T) {
				fresh(t, d, id, endpointEgressLimit(burst))
				before := srcMismatches(t, d)
				dropped := check == maps.SourceDrop && tc.mismatch
				for i := range burst + 1 {
					want := uint32(xdpPass)
					if dropped || i == burst {
						want = xdpDrop
					}
					if got := run(tc.src); got != want {
						t.Fatalf("packet %d from %s: verdict %d, want %d", i+1, tc.src, got, want)
					}
				}
				n := srcMismatches(t, d) - before
				switch {
				case tc.mismatch && n != burst+1:
					t.Errorf("source mismatches counted %d, want %d", n, burst+1)
				case !tc.mismatch && n != 0:
					t.Errorf("source mismatches counted %d, want 0", n)
				}
				st := mustStats(t, d, id)
				if dropped {
					// Dropped before any limit: charged to none.
					if st.AdmittedPackets+st.DroppedPackets != 0 {
						t.Errorf("dropped as a mismatch, yet charged: %+v", st)
					}
					return
				}
				if st.AdmittedPackets != burst || st.DroppedPackets != 1 {
					t.Errorf("admitted %d, dropped %d: want %d and 1 (the endpoint's bucket)", st.AdmittedPackets, st.DroppedPackets, burst)
				}
				if got := bucketAddrs(t, d, id); !slices.Equal(got, []netip.Addr{tc.charged}) {
					t.Errorf("buckets %v, want only the endpoint's %v", got, tc.charged)
				}
			})
		}
	}
	if err := d.SetSourceCheck(maps.SourceCount); err != nil {
		t.Fatal(err)
	}

	// The neighbour's own bucket is not drawn on by the pod's forgeries:
	// after the pod spent its burst as the neighbour, the neighbour's
	// packets (on the neighbour's interface: here the same test
	// interface, written as the neighbour's) still have theirs.
	t.Run("the neighbour keeps its bucket", func(t *testing.T) {
		fresh(t, d, id, endpointEgressLimit(burst))
		setSources(epAddr4, epAddr6)
		for range burst + 1 {
			run(neighbour4)
		}
		setSources(netip.MustParseAddr(neighbour4))
		defer setSources(epAddr4, epAddr6)
		passed := 0
		for range burst {
			if run(neighbour4) == xdpPass {
				passed++
			}
		}
		if passed != burst {
			t.Errorf("the neighbour passed %d of %d after the pod forged its address", passed, burst)
		}
	})

	// An endpoint without an address of the packet's family: charged as
	// the unspecified address, which the limit's srcCIDRs do not hold, so
	// a forged neighbour's address draws nothing from the neighbour.
	t.Run("no address of the family", func(t *testing.T) {
		fresh(t, d, id, endpointEgressLimit(burst))
		setSources(epAddr4)
		defer setSources(epAddr4, epAddr6)
		before := srcMismatches(t, d)
		for range burst + 1 {
			if got := run(neighbour6); got != xdpPass {
				t.Fatalf("verdict %d, want pass (charged as ::, no limit's)", got)
			}
		}
		if st := mustStats(t, d, id); st.AdmittedPackets+st.DroppedPackets != 0 {
			t.Errorf("charged %+v as the neighbour's", st)
		}
		if n := srcMismatches(t, d) - before; n != burst+1 {
			t.Errorf("source mismatches counted %d, want %d", n, burst+1)
		}
	})

	// An interface the agent wrote nothing for is not checked (the agent
	// writes an endpoint's addresses before it attaches there): packets
	// are charged by their own source and not counted.
	t.Run("an interface not written", func(t *testing.T) {
		fresh(t, d, id, endpointEgressLimit(burst))
		if err := d.SetEndpointSources(nil); err != nil {
			t.Fatal(err)
		}
		defer setSources(epAddr4, epAddr6)
		before := srcMismatches(t, d)
		run(neighbour4)
		if got := bucketAddrs(t, d, id); !slices.Equal(got, []netip.Addr{netip.MustParseAddr(neighbour4)}) {
			t.Errorf("buckets %v, want the packet's own source", got)
		}
		if n := srcMismatches(t, d) - before; n != 0 {
			t.Errorf("source mismatches counted %d on an interface not written", n)
		}
	})

	// The check is the endpoints' egress only: the other programs charge
	// a packet by its own source.
	forEachProg(t, []prog{xdpProg, tcProgs[0], tcProgs[1], tcProgs[2]}, func(t *testing.T, p prog) {
		l := endpointEgressLimit(burst)
		l.Match.Attach, l.Match.Direction = p.hook.Attach(), p.hook.Direction()
		fresh(t, d, id, l)
		before := srcMismatches(t, d)
		p.run(t, d, egressFrom(neighbour4))
		if got := bucketAddrs(t, d, id); !slices.Equal(got, []netip.Addr{netip.MustParseAddr(neighbour4)}) {
			t.Errorf("buckets %v, want the packet's own source", got)
		}
		if n := srcMismatches(t, d) - before; n != 0 {
			t.Errorf("source mismatches counted %d", n)
		}
	})
}
