package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/maps"
)

// The applier's tables, on the in-memory store (memStore, which passes the
// data path's contract): no root. The reconcile tests (reconcile_test.go,
// isolation_test.go) keep one root test per behaviour on the real data
// path.

// testApplier is an applier on a memStore whose prefix tables hold room
// prefixes each, logging into logs.
func testApplier(room int) (*applier, *memStore, *logBuffer) {
	s := newMemStore(room)
	logs := &logBuffer{}
	ap := newApplier(s, slog.New(slog.NewTextHandler(logs, nil)))
	return &ap, s, logs
}

func mustApply(tb testing.TB, ap *applier, n int, limits ...v1alpha1.Limit) {
	tb.Helper()
	if err := ap.apply(counted(n, limits...), nil); err != nil {
		tb.Fatalf("apply: %v", err)
	}
}

// udpLimit is a limit on UDP to port.
func udpLimit(tb testing.TB, name string, rate, port int) v1alpha1.Limit {
	return limit(tb, name, fmt.Sprintf(`{rate: %d, match: {protocol: udp, dstPorts: ["%d"]}}`, rate, port))
}

// srcLimit is a limit of n distinct IPv4 sources from 10.0.0.0 + first.
func srcLimit(tb testing.TB, name string, rate, first, n int) v1alpha1.Limit {
	l := limit(tb, name, fmt.Sprintf(`{rate: %d, match: {protocol: udp}}`, rate))
	for _, p := range sources(first, n) {
		l.Match.SrcCIDRs = append(l.Match.SrcCIDRs, p.Addr().String())
	}
	return l
}

// entry is the store's entry for name, by the id its metadata gives it.
func entry(tb testing.TB, s *memStore, name string) (maps.Limit, uint32) {
	tb.Helper()
	for id, m := range s.metas {
		if m.Name == name {
			l, ok := s.limits[id]
			if !ok {
				tb.Fatalf("%s (id %d) has no entry", name, id)
			}
			return l, id
		}
	}
	tb.Fatalf("%s has no metadata", name)
	return maps.Limit{}, noID
}

func outcomeOf(tb testing.TB, ap *applier, name string) *outcome {
	tb.Helper()
	o := ap.outcomes[name]
	if o == nil {
		tb.Fatalf("no outcome for %s", name)
	}
	return o
}

// Shares follow the count and each limit keeps its id; an unchanged pass
// writes nothing; a removed limit leaves nothing behind and a limit added in
// the same pass does not take its id (it would inherit its buckets).
func TestApplyFollowsCount(t *testing.T) {
	ap, s, _ := testApplier(srcTable)
	dns, web := udpLimit(t, "dns", 100000, 53), udpLimit(t, "web", 30000, 80)
	mustApply(t, ap, 1, dns, web)
	_, dnsID := entry(t, s, "dns")
	_, webID := entry(t, s, "web")
	if dnsID == webID {
		t.Fatal("two limits share an id")
	}
	for _, n := range []int{2, 10, 0, 3} {
		mustApply(t, ap, n, dns, web)
		div := uint64(max(n, 1))
		l, id := entry(t, s, "dns")
		if l.Rate != 100000/div || id != dnsID || s.metas[id].Replicas != uint32(n) {
			t.Errorf("count %d: dns %d/s id %d replicas %d, want %d/s id %d", n, l.Rate, id, s.metas[id].Replicas, 100000/div, dnsID)
		}
	}
	sets, metas := s.sets, len(s.metas)
	mustApply(t, ap, 3, dns, web)
	mustApply(t, ap, 3, dns, web)
	if s.sets != sets || len(s.metas) != metas {
		t.Errorf("unchanged passes wrote %d entries", s.sets-sets)
	}

	ntp := udpLimit(t, "ntp", 1000, 123)
	mustApply(t, ap, 2, web, ntp)
	if _, ok := s.limits[dnsID]; ok {
		t.Error("removed limit still in the store")
	}
	if _, ok := s.metas[dnsID]; ok {
		t.Error("removed limit's metadata left behind")
	}
	if l, id := entry(t, s, "ntp"); id == dnsID || l.Rate != 500 {
		t.Errorf("ntp: id %d (dns had %d), %d/s; want a new id at 500/s", id, dnsID, l.Rate)
	}
	if ap.outcomes["dns"] != nil {
		t.Error("removed limit still has an outcome")
	}
}

// A store an earlier agent left is taken as it is: ids by the metadata's
// names, unchanged entries not rewritten, what is not configured removed;
// of two ids with one name, the one with an entry stays.
func TestApplyAdoptsWhatTheStoreHolds(t *testing.T) {
	ap, s, _ := testApplier(srcTable)
	dns := udpLimit(t, "dns", 1000, 53)
	// An earlier agent: dns at id 7 with its share of 4, a stray entry of
	// dns at 3 with no entry, and a limit no longer configured.
	first, _, _ := testApplier(srcTable)
	first.store = s
	mustApply(t, first, 4, dns, udpLimit(t, "old", 10, 9))
	_, dnsID := entry(t, s, "dns")
	stray := uint32(60)
	s.metas[stray] = maps.Meta{Name: "dns"}
	sets := s.sets

	mustApply(t, ap, 4, dns)
	if _, id := entry(t, s, "dns"); id != dnsID || s.sets != sets {
		t.Errorf("dns: id %d (was %d), %d entries written; want its id and no write", id, dnsID, s.sets-sets)
	}
	if len(s.metas) != 1 || len(s.limits) != 1 {
		t.Errorf("store after adoption: %d metas, %d entries; want dns's alone", len(s.metas), len(s.limits))
	}
}

// More limits than the data path has ids: the ones that find none (new
// limits take ids in name order) are rejected with a reason, the others
// follow the count; a new limit never takes the place of one in the store,
// and rejected ones take the places that free up, in name order.
func TestApplyMoreLimitsThanIDs(t *testing.T) {
	ap, s, logs := testApplier(srcTable)
	n := int(maps.MaxLimits) + 2
	var limits []v1alpha1.Limit
	for i := range n {
		limits = append(limits, udpLimit(t, fmt.Sprintf("l%03d", i), 10000+i, 1000+i))
	}
	mustApply(t, ap, 2, limits...)
	rejected := []string{fmt.Sprintf("l%03d", n-2), fmt.Sprintf("l%03d", n-1)}
	check := func(what string, count int, rejected []string, limits []v1alpha1.Limit) {
		t.Helper()
		if len(s.limits) != int(maps.MaxLimits) {
			t.Errorf("%s: %d entries, want %d", what, len(s.limits), maps.MaxLimits)
		}
		for _, l := range limits {
			o := outcomeOf(t, ap, l.Name)
			if slices.Contains(rejected, l.Name) {
				if o.id != noID || o.state != maps.Rejected || !strings.Contains(o.note, fmt.Sprint(maps.MaxLimits)) {
					t.Errorf("%s: %s: id %d state %v note %q, want rejected naming %d", what, l.Name, o.id, o.state, o.note, maps.MaxLimits)
				}
				continue
			}
			if e, _ := entry(t, s, l.Name); o.state != maps.Applied || e.Rate != l.Rate/uint64(count) {
				t.Errorf("%s: %s: state %v, %d/s, want applied at %d", what, l.Name, o.state, e.Rate, l.Rate/uint64(count))
			}
		}
	}
	check("start", 2, rejected, limits)
	for _, name := range rejected {
		if logs.count(`msg="limit not applied"`, "limit="+name+" ") != 1 {
			t.Errorf("no single log line says %s is not applied", name)
		}
	}
	mustApply(t, ap, 4, limits...)
	check("count 4", 4, rejected, limits)

	first := udpLimit(t, "a-new", 100, 9) // sorts first
	withNew := append([]v1alpha1.Limit{first}, limits...)
	mustApply(t, ap, 4, withNew...)
	check("a-new added", 4, append(slices.Clone(rejected), "a-new"), withNew)

	// Three go: a-new and the two rejected take their places.
	fewer := append([]v1alpha1.Limit{first}, limits[3:]...)
	mustApply(t, ap, 4, fewer...)
	check("three removed", 4, nil, fewer)
}

// More prefixes than the tables hold: the limit that overflows them, in
// the order limits claim room, is rejected and the others follow the count;
// a new version that does not fit leaves the previous one enforced (and
// following the count) until room frees up; a rejected limit that goes
// leaves no metadata behind.
func TestApplyPrefixTableOverflow(t *testing.T) {
	ap, s, logs := testApplier(40)
	aa, bb, cc := srcLimit(t, "aa", 3000, 0, 30), srcLimit(t, "bb", 1500, 1000, 15), srcLimit(t, "cc", 600, 2000, 2)
	mustApply(t, ap, 1, aa, bb, cc)
	want := func(what, name string, state maps.MetaState, enforced bool, rate uint64, prefixes int) {
		t.Helper()
		o := outcomeOf(t, ap, name)
		if o.state != state || (o.enforced != nil) != enforced {
			t.Errorf("%s: %s: state %v enforced %v (%q), want %v, %v", what, name, o.state, o.enforced != nil, o.note, state, enforced)
			return
		}
		if !enforced {
			if _, ok := s.limits[o.id]; ok {
				t.Errorf("%s: %s has an entry", what, name)
			}
			return
		}
		if e, _ := entry(t, s, name); e.Rate != rate || len(e.Match.SrcCIDRs) != prefixes {
			t.Errorf("%s: %s: %d/s with %d prefixes, want %d with %d", what, name, e.Rate, len(e.Match.SrcCIDRs), rate, prefixes)
		}
	}
	want("start", "aa", maps.Applied, true, 3000, 30)
	want("start", "bb", maps.Rejected, false, 0, 0)
	want("start", "cc", maps.Applied, true, 600, 2)
	if o := outcomeOf(t, ap, "bb"); !strings.Contains(o.note, "table full") || !strings.Contains(o.note, "source prefixes") {
		t.Errorf("bb's note %q does not say which table is full", o.note)
	}
	mustApply(t, ap, 3, aa, bb, cc)
	want("count 3", "aa", maps.Applied, true, 1000, 30)
	want("count 3", "cc", maps.Applied, true, 200, 2)

	grown := srcLimit(t, "cc", 900, 2000, 12) // with aa's 30: past the 40
	mustApply(t, ap, 3, aa, bb, grown)
	want("cc grown", "cc", maps.Rejected, true, 200, 2)
	if o := outcomeOf(t, ap, "cc"); !strings.Contains(o.note, "previous") {
		t.Errorf("cc's note %q does not say the previous version stays", o.note)
	}
	if logs.count("previous version stays enforced", "limit=cc") != 1 {
		t.Errorf("no single log line says cc's previous version stays:\n%s", logs.buf.String())
	}
	mustApply(t, ap, 2, aa, bb, grown)
	want("cc grown, count 2", "cc", maps.Rejected, true, 300, 2)
	want("cc grown, count 2", "aa", maps.Applied, true, 1500, 30)

	bbID := outcomeOf(t, ap, "bb").id
	mustApply(t, ap, 2, aa, grown)
	if _, ok := s.metas[bbID]; ok {
		t.Errorf("bb's metadata (id %d) left behind after its removal", bbID)
	}
	want("bb removed", "cc", maps.Rejected, true, 300, 2) // 30 + 12 is still over

	mustApply(t, ap, 2, grown)
	want("aa removed", "cc", maps.Applied, true, 450, 12)
}

// A limit that grows into room another frees in the same pass is applied
// whatever their ids: the changes that free room are written first.
func TestApplyShrinkBeforeGrow(t *testing.T) {
	ap, s, _ := testApplier(40)
	mustApply(t, ap, 1, srcLimit(t, "aa", 100, 0, 10), srcLimit(t, "bb", 100, 1000, 30))
	_, aaID := entry(t, s, "aa")
	_, bbID := entry(t, s, "bb")
	if aaID >= bbID {
		t.Fatalf("ids aa %d, bb %d: the test needs aa first", aaID, bbID)
	}
	var order []string
	s.log = &order
	// aa grows by 10, bb shrinks by 10: 40 in the end, 50 if aa went first.
	mustApply(t, ap, 1, srcLimit(t, "aa", 100, 0, 20), srcLimit(t, "bb", 100, 1000, 20))
	for _, name := range []string{"aa", "bb"} {
		if o := outcomeOf(t, ap, name); o.state != maps.Applied {
			t.Errorf("%s: %v (%q), want applied", name, o.state, o.note)
		}
	}
	if want := []string{fmt.Sprintf("set %d", bbID), fmt.Sprintf("set %d", aaID)}; !slices.Equal(order, want) {
		t.Errorf("writes %v, want %v (the shrinking first)", order, want)
	}
}

// A limit the tables had no room for is not tried again while no room was
// freed (a count change pays no classifier build per rejected limit), and
// is applied in the pass that frees room.
func TestApplyRetriesWhenRoomFrees(t *testing.T) {
	ap, s, _ := testApplier(40)
	aa, bb := srcLimit(t, "aa", 3000, 0, 30), srcLimit(t, "bb", 1500, 1000, 15)
	mustApply(t, ap, 1, aa, bb)
	full := s.full
	if full != 1 {
		t.Fatalf("%d writes refused, want bb's", full)
	}
	for n := 2; n <= 4; n++ {
		mustApply(t, ap, n, aa, bb)
		if s.full != full {
			t.Errorf("count %d: bb tried again with no room freed", n)
		}
		if o := outcomeOf(t, ap, "bb"); o.state != maps.Rejected {
			t.Fatalf("count %d: bb %v", n, o.state)
		}
	}
	mustApply(t, ap, 4, srcLimit(t, "aa", 3000, 0, 20), bb)
	if e, _ := entry(t, s, "bb"); outcomeOf(t, ap, "bb").state != maps.Applied || e.Rate != 1500/4 {
		t.Errorf("after aa shrank: bb %v at %d/s, want applied at %d", outcomeOf(t, ap, "bb").state, e.Rate, 1500/4)
	}
}

// A write that fails (not a limit that does not fit) is the pass's error;
// the limit is reported, the previous version stays, and the next pass
// applies it.
func TestApplyWriteFails(t *testing.T) {
	ap, s, _ := testApplier(srcTable)
	dns, web := udpLimit(t, "dns", 1000, 53), udpLimit(t, "web", 3000, 80)
	mustApply(t, ap, 1, dns)
	s.failSet = errors.New("map update: no memory")
	err := ap.apply(counted(2, dns, web), nil)
	if err == nil || !strings.Contains(err.Error(), "no memory") || !strings.Contains(err.Error(), "limit web") {
		t.Errorf("apply: %v, want the failed writes", err)
	}
	if e, _ := entry(t, s, "dns"); e.Rate != 1000 || outcomeOf(t, ap, "dns").state != maps.Rejected {
		t.Errorf("dns: %d/s, %v; want the previous version (1000/s) kept and reported", e.Rate, outcomeOf(t, ap, "dns").state)
	}
	if o := outcomeOf(t, ap, "web"); o.state != maps.Rejected || !strings.HasPrefix(o.note, "not applied: ") {
		t.Errorf("web: %v %q", o.state, o.note)
	}
	s.failSet = nil
	mustApply(t, ap, 2, dns, web)
	for name, rate := range map[string]uint64{"dns": 500, "web": 1500} {
		if e, _ := entry(t, s, name); e.Rate != rate || outcomeOf(t, ap, name).state != maps.Applied {
			t.Errorf("%s after the store mended: %d/s %v", name, e.Rate, outcomeOf(t, ap, name).state)
		}
	}
}

// A clamped share is logged once per change, and its return to the
// configured share once.
func TestApplyClampedLoggedOnce(t *testing.T) {
	ap, s, logs := testApplier(srcTable)
	huge := udpLimit(t, "huge", 1, 9)
	huge.Rate = 5 * maps.MaxRate
	for _, n := range []int{2, 2, 3} {
		mustApply(t, ap, n, huge)
		if e, _ := entry(t, s, "huge"); e.Rate != maps.MaxRate || s.metas[outcomeOf(t, ap, "huge").id].State != maps.Clamped {
			t.Errorf("count %d: %d/s, want clamped to %d and recorded so", n, e.Rate, maps.MaxRate)
		}
	}
	if n := logs.count(`msg="limit clamped"`, "limit=huge"); n != 2 {
		t.Errorf("%d clamp log lines, want 2 (one per change)", n)
	}
	mustApply(t, ap, 6, huge)
	if o := outcomeOf(t, ap, "huge"); o.state != maps.Applied || logs.count(`msg="limit applied as configured"`, "limit=huge") != 1 {
		t.Errorf("count 6: %v, want applied, logged once", o.state)
	}
}

// hooksFirst sees every limit the store will hold, with their endpoint
// hooks, before any entry is written.
func TestApplyHooksFirst(t *testing.T) {
	ap, s, _ := testApplier(srcTable)
	old := udpLimit(t, "old", 100, 9)
	mustApply(t, ap, 1, old)
	pod := attach.Endpoint{Addr: netip.MustParseAddr("10.1.0.5"), Iface: "veth5"}
	ep := limit(t, "ep", `{rate: 100, attach: endpoints, match: {dstCIDRs: [10.1.0.5]}}`)
	in := counted(1, old, ep)
	in.endpoints = endpointTable{addrs: map[netip.Addr]attach.Endpoint{pod.Addr: pod}}
	sets := s.sets
	called := false
	err := ap.apply(in, func(limits []maps.Limit, points []placement) {
		called = true
		if s.sets != sets {
			t.Errorf("%d entries written before the hooks", s.sets-sets)
		}
		if len(limits) != 3 || !slices.ContainsFunc(limits, func(l maps.Limit) bool { return l.Match.Attach == maps.Endpoints }) {
			t.Errorf("hooksFirst limits %+v, want old (held and planned) and ep", limits)
		}
		if len(points) != 1 || points[0].point.Iface != "veth5" {
			t.Errorf("hooksFirst points %+v, want veth5's", points)
		}
	})
	if err != nil || !called {
		t.Fatalf("apply: %v, hooksFirst called %v", err, called)
	}
	if pts := ap.points(); len(pts) != 1 || pts[0].point.Iface != "veth5" {
		t.Errorf("points after the pass: %+v", pts)
	}
}
