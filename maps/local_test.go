package maps

import (
	"encoding/binary"
	"net/netip"
	"slices"
	"testing"

	"github.com/rlagent/rlagent/bpf"
)

// localIn lists what rl_local holds, as addresses with their kinds.
func localIn(t *testing.T, d *Datapath) map[netip.Addr]LocalKind {
	t.Helper()
	out := make(map[netip.Addr]LocalKind)
	var k bpf.RatelimitRlLocalKey
	var v uint32
	it := d.objs.RlLocal.Iterate()
	for it.Next(&k, &v) {
		var b [16]byte
		for i, w := range k.A {
			binary.NativeEndian.PutUint32(b[4*i:], w)
		}
		a := netip.AddrFrom16(b)
		if k.Family == 4 {
			a = netip.AddrFrom4([4]byte(b[12:]))
		}
		out[a] = LocalKind(v)
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// A complete list replaces what rl_local holds; a list that may be
// incomplete (AddLocalAddresses, after an interrupted netlink dump) only
// adds, so that a node address it missed keeps its protect rules.
func TestLocalAddressesAddRemovesNothing(t *testing.T) {
	d := loadTest(t, Options{})
	a, b, c := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8::1"), netip.MustParseAddr("10.244.1.7")
	check := func(what string, want map[netip.Addr]LocalKind) {
		t.Helper()
		got := localIn(t, d)
		keys := func(m map[netip.Addr]LocalKind) []netip.Addr {
			var out []netip.Addr
			for k := range m {
				out = append(out, k)
			}
			slices.SortFunc(out, netip.Addr.Compare)
			return out
		}
		if len(got) != len(want) {
			t.Fatalf("%s: rl_local holds %v, want %v", what, keys(got), keys(want))
		}
		for k, v := range want {
			if got[k] != v {
				t.Fatalf("%s: rl_local[%s] = %d, want %d (holds %v)", what, k, got[k], v, keys(got))
			}
		}
	}
	if err := d.SetLocalAddresses(map[netip.Addr]LocalKind{a: LocalNode, b: LocalNode}); err != nil {
		t.Fatal(err)
	}
	check("set a, b", map[netip.Addr]LocalKind{a: LocalNode, b: LocalNode})
	if err := d.AddLocalAddresses(map[netip.Addr]LocalKind{c: LocalEndpoint, b: LocalNode | LocalEndpoint}); err != nil {
		t.Fatal(err)
	}
	check("add c, b", map[netip.Addr]LocalKind{a: LocalNode, b: LocalNode | LocalEndpoint, c: LocalEndpoint})
	if err := d.SetLocalAddresses(map[netip.Addr]LocalKind{c: LocalEndpoint}); err != nil {
		t.Fatal(err)
	}
	check("set c", map[netip.Addr]LocalKind{c: LocalEndpoint})
}
