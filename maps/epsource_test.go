package maps

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"testing"

	"github.com/rlagent/rlagent/bpf"
)

// epSourcesIn lists what rl_ep_src holds, an entry a line: "ifindex
// address" for an address, "ifindex family -> address" for the address a
// family's other packets are charged as, "ifindex" for the interface's
// entry.
func epSourcesIn(t *testing.T, d *Datapath) []string {
	t.Helper()
	addr := func(family uint32, a [4]uint32) netip.Addr {
		var b [16]byte
		for i, w := range a {
			binary.NativeEndian.PutUint32(b[4*i:], w)
		}
		if family == 4 {
			return netip.AddrFrom4([4]byte(b[12:]))
		}
		return netip.AddrFrom16(b)
	}
	var out []string
	var k bpf.RatelimitRlEpKey
	var v bpf.RatelimitRlEpAddr
	it := d.objs.RlEpSrc.Iterate()
	for it.Next(&k, &v) {
		switch {
		case k.Family == 0:
			out = append(out, fmt.Sprint(k.Ifindex))
		case k.A == [4]uint32{}:
			out = append(out, fmt.Sprintf("%d %d -> %s", k.Ifindex, k.Family, addr(k.Family, v.A)))
		default:
			out = append(out, fmt.Sprintf("%d %s", k.Ifindex, addr(k.Family, k.A)))
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// SetEndpointSources writes each interface's addresses, the lowest of each
// family as the one the family's other packets are charged as, and the
// interface's entry; a complete list replaces the map, an incomplete one
// (AddEndpointSources) only adds. The check mode survives a classifier
// rewrite (SetLimit), which writes rl_cfg whole.
func TestEndpointSources(t *testing.T) {
	d := loadTest(t, Options{})
	mp := netip.MustParseAddr
	check := func(what string, want ...string) {
		t.Helper()
		if got := epSourcesIn(t, d); !slices.Equal(got, want) {
			t.Fatalf("%s: rl_ep_src holds\n%q\nwant\n%q", what, got, want)
		}
	}
	err := d.SetEndpointSources(map[int][]netip.Addr{
		7: {mp("10.1.0.9"), mp("fd00::5"), mp("10.1.0.5"), mp("::ffff:10.1.0.6")},
		9: {mp("fd00::7")},
		0: {mp("10.9.9.9")}, // no interface: nothing
	})
	if err != nil {
		t.Fatal(err)
	}
	check("set", "7", "7 10.1.0.5", "7 10.1.0.6", "7 10.1.0.9", "7 4 -> 10.1.0.5", "7 6 -> fd00::5", "7 fd00::5",
		"9", "9 6 -> fd00::7", "9 fd00::7")
	if err := d.AddEndpointSources(map[int][]netip.Addr{9: {mp("10.2.0.1")}}); err != nil {
		t.Fatal(err)
	}
	check("add", "7", "7 10.1.0.5", "7 10.1.0.6", "7 10.1.0.9", "7 4 -> 10.1.0.5", "7 6 -> fd00::5", "7 fd00::5",
		"9", "9 10.2.0.1", "9 4 -> 10.2.0.1", "9 6 -> fd00::7", "9 fd00::7")
	if err := d.SetEndpointSources(map[int][]netip.Addr{9: {mp("fd00::7")}}); err != nil {
		t.Fatal(err)
	}
	check("set again", "9", "9 6 -> fd00::7", "9 fd00::7")

	if err := d.SetSourceCheck(SourceCheck(7)); err == nil {
		t.Error("SetSourceCheck(7): no error")
	}
	if err := d.SetSourceCheck(SourceDrop); err != nil {
		t.Fatal(err)
	}
	l := Limit{Rate: 10, Burst: 10, Match: Match{Attach: Endpoints, Direction: Egress,
		SrcCIDRs: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/24")}}}
	if err := d.SetLimit(1, l); err != nil {
		t.Fatal(err)
	}
	var cfg bpf.RatelimitRlConfig
	if err := d.objs.RlCfg.Lookup(uint32(0), &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.EpSrcCheck != uint32(SourceDrop) {
		t.Errorf("after SetLimit, rl_cfg's source check is %d, want drop (%d)", cfg.EpSrcCheck, SourceDrop)
	}
}
