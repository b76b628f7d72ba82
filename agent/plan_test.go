package agent

import (
	"errors"
	"net/netip"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/maps"
	"github.com/rlagent/rlagent/watcher"
)

// The plan's tables: what plan decides from data alone. They need no root
// and no data path; the reconcile tests (reconcile_test.go,
// isolation_test.go) apply plans to a real one.

// limit is a limit as the agent gets it: parsed, and defaulted as a config
// file's or the informer's are.
func limit(tb testing.TB, name, spec string) v1alpha1.Limit {
	tb.Helper()
	var l v1alpha1.Limit
	if err := yaml.UnmarshalStrict([]byte(spec), &l.RateLimitSpec); err != nil {
		tb.Fatalf("%s: %v", name, err)
	}
	l.Name = name
	l.Default()
	return l
}

// counted is a planInputs with these limits, each divided by n.
func counted(n int, limits ...v1alpha1.Limit) *planInputs {
	in := &planInputs{limits: limits, obs: map[string]watcher.Observation{}}
	for _, l := range limits {
		in.obs[l.Name] = watcher.Observation{Replicas: n, Local: n}
	}
	return in
}

func byName(ds []*desiredLimit, name string) *desiredLimit {
	for _, d := range ds {
		if d.name == name {
			return d
		}
	}
	return nil
}

func mustPlan(tb testing.TB, in *planInputs, name string) *desiredLimit {
	tb.Helper()
	d := byName(plan(in), name)
	if d == nil {
		tb.Fatalf("no %s in the plan", name)
	}
	return d
}

// Shares follow the count (Watch -> Divide): the entry's rate and burst,
// and the metadata's count and global values.
func TestPlanDividesByTheCount(t *testing.T) {
	dns := limit(t, "dns", `{rate: 100000, burst: 10000, match: {protocol: udp, dstPorts: ["53"]}}`)
	web := limit(t, "web", `{rate: 30000, match: {protocol: tcp, dstPorts: ["80", "443"]}, key: src-ip}`)
	for _, n := range []int{1, 2, 10, 0, 3, -1} {
		in := counted(n, dns, web)
		at := time.Unix(1_700_000_000, 0)
		in.obs["dns"] = watcher.Observation{Replicas: n, Local: n, At: at}
		ds := plan(in)
		if len(ds) != 2 {
			t.Fatalf("count %d: %d limits planned, want 2", n, len(ds))
		}
		div := uint64(max(n, 1))
		d := byName(ds, "dns")
		if d.limit.Rate != 100000/div || d.limit.Burst != max(10000/div, 1) || d.limit.Unit != maps.Packets {
			t.Errorf("count %d: dns %d/s burst %d unit %v, want %d and %d packets", n, d.limit.Rate, d.limit.Burst, d.limit.Unit, 100000/div, 10000/div)
		}
		wantMeta := maps.Meta{Name: "dns", GlobalRate: 100000, GlobalBurst: 10000, Scope: scopeStatic,
			Replicas: uint32(max(n, 0)), Local: uint32(max(n, 0)), Observed: at}
		if d.meta != wantMeta {
			t.Errorf("count %d: meta %+v, want %+v", n, d.meta, wantMeta)
		}
		if (d.warn != "") != (n < 1) {
			t.Errorf("count %d: warning %q", n, d.warn)
		}
		w := byName(ds, "web")
		if w.limit.Rate != 30000/div || w.limit.Key != maps.KeySrcIP || w.limit.Match.Protocol != maps.TCP ||
			!slices.Equal(w.limit.Match.DstPorts, []maps.PortRange{{First: 80, Last: 80}, {First: 443, Last: 443}}) {
			t.Errorf("count %d: web %+v", n, w.limit)
		}
		if d.state != maps.Applied || d.note != "" || d.unfit != nil || w.unfit != nil {
			t.Errorf("count %d: state %v note %q unfit %v %v", n, d.state, d.note, d.unfit, w.unfit)
		}
	}
	// The file source is recorded as the limits' scope; a stale count too.
	in := counted(2, dns)
	in.countFile = true
	in.obs["dns"] = watcher.Observation{Replicas: 2, Err: errors.New("unreadable")}
	if d := mustPlan(t, in, "dns"); d.meta.Scope != scopeFile || !d.meta.Stale || d.limit.Rate != 50000 {
		t.Errorf("file source, stale: scope %d stale %v rate %d, want %d, true, 50000 (the last count stands)", d.meta.Scope, d.meta.Stale, d.limit.Rate, scopeFile)
	}
}

// A limit with unit requests is the limiter library's, in the Service's
// own processes: no node plans it, so it takes no id and no room, and a
// packet limit beside it is planned as ever.
func TestPlanSkipsRequests(t *testing.T) {
	api := limit(t, "api", `{rate: 300, unit: requests, scope: service, key: custom, onEmpty: wait, match: {service: shop/api}}`)
	file := limit(t, "file", `{rate: 300, unit: requests, match: {}}`)
	dns := limit(t, "dns", `{rate: 100, match: {protocol: udp}}`)
	in := counted(3, api, file, dns)
	in.service = map[string]serviceEndpoints{"api": {local: []watcher.Endpoint{{Addr: netip.MustParseAddr("10.0.0.1")}}}}
	ds := plan(in)
	if len(ds) != 1 || ds[0].name != "dns" || ds[0].id != 0 {
		t.Fatalf("plan = %v, want only dns, at id 0", names(ds))
	}
	if warnings, err := ValidateConfig(&v1alpha1.Config{Limits: []v1alpha1.Limit{file, dns}}); err != nil || len(warnings) > 0 {
		t.Errorf("ValidateConfig with a limit of requests: %v, %v, want no problem (it matches no packet)", warnings, err)
	}
}

func names(ds []*desiredLimit) []string {
	var out []string
	for _, d := range ds {
		out = append(out, d.name)
	}
	return out
}

// Ids: a limit keeps its id; new limits take the free ids in name order,
// never one that is taken (a removed limit's buckets); with none free a
// new limit is unfit and the others are planned all the same. The plan
// lists the installed limits first, by id, then the others by id.
func TestPlanIDs(t *testing.T) {
	l := func(name string) v1alpha1.Limit { return limit(t, name, `{rate: 1000, match: {protocol: udp}}`) }
	for _, tt := range []struct {
		name      string
		limits    []string
		ids       map[string]uint32
		taken     []uint32
		installed []uint32
		want      []string // name=id, in the plan's order; id -1: noID
	}{
		{name: "new limits in name order", limits: []string{"c", "a", "b"},
			want: []string{"a=0", "b=1", "c=2"}},
		{name: "kept ids, new ones around the taken", limits: []string{"a", "b", "c", "d"},
			ids: map[string]uint32{"c": 0, "a": 2}, taken: []uint32{0, 1, 2}, installed: []uint32{0, 2},
			want: []string{"c=0", "a=2", "b=3", "d=4"}},
		{name: "an installed limit claims room before a lower id that is not", limits: []string{"a", "b"},
			ids: map[string]uint32{"a": 1, "b": 5}, taken: []uint32{1, 5}, installed: []uint32{5},
			want: []string{"b=5", "a=1"}},
		{name: "no free id", limits: []string{"a", "z"},
			ids: map[string]uint32{"a": 3}, taken: allIDsBut(), installed: []uint32{3},
			want: []string{"a=3", "z=-1"}},
		{name: "the last free id", limits: []string{"x", "y"},
			taken: allIDsBut(maps.MaxLimits - 1),
			want:  []string{"x=" + itoa(maps.MaxLimits-1), "y=-1"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var limits []v1alpha1.Limit
			for _, n := range tt.limits {
				limits = append(limits, l(n))
			}
			in := counted(1, limits...)
			in.ids, in.taken, in.installed = tt.ids, set(tt.taken), set(tt.installed)
			takenBefore := len(in.taken)
			ds := plan(in)
			var got []string
			for _, d := range ds {
				id := "-1"
				if d.id != noID {
					id = itoa(d.id)
				}
				got = append(got, d.name+"="+id)
				if (d.id == noID) != (d.unfit != nil) {
					t.Errorf("%s: id %d, unfit %v", d.name, d.id, d.unfit)
				}
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("plan %v, want %v", got, tt.want)
			}
			if len(in.taken) != takenBefore {
				t.Errorf("plan wrote its input: %d ids taken, was %d", len(in.taken), takenBefore)
			}
		})
	}
}

func allIDsBut(free ...uint32) []uint32 {
	var ids []uint32
	for id := range uint32(maps.MaxLimits) {
		if !slices.Contains(free, id) {
			ids = append(ids, id)
		}
	}
	return ids
}

func set(ids []uint32) map[uint32]bool {
	m := make(map[uint32]bool, len(ids))
	for _, id := range ids {
		m[id] = true
	}
	return m
}

func itoa(id uint32) string { return strconv.FormatUint(uint64(id), 10) }

// A share above the data path's range is clamped and says so; a spec the
// data path cannot express is unfit, and the limits around it are planned.
func TestPlanClampAndUnfit(t *testing.T) {
	big := limit(t, "big", `{rate: 1000, match: {protocol: udp}}`)
	big.Rate = maps.MaxRate * 4 // past validation, as only a hand-made object gets here
	bad := limit(t, "bad", `{rate: 1000, match: {protocol: udp}}`)
	bad.Match.Protocol = "sctp"
	ok := limit(t, "ok", `{rate: 1000, match: {protocol: udp}}`)
	ds := plan(counted(2, big, bad, ok))
	if d := byName(ds, "big"); d.limit.Rate != maps.MaxRate || d.state != maps.Clamped || !strings.Contains(d.note, "clamped") || d.unfit != nil {
		t.Errorf("big: rate %d state %v note %q unfit %v, want %d clamped", d.limit.Rate, d.state, d.note, d.unfit, maps.MaxRate)
	}
	if d := byName(ds, "bad"); d.unfit == nil || !strings.Contains(d.unfit.Error(), "sctp") {
		t.Errorf("bad: unfit %v, want the protocol named", d.unfit)
	}
	if d := byName(ds, "ok"); d.unfit != nil || d.limit.Rate != 500 {
		t.Errorf("ok: %+v unfit %v", d.limit, d.unfit)
	}
}

// share demand: the demand step's rate replaces the equal share, with the
// burst scaled to it; a limit without demand sharing ignores it, and one
// without a rate from the step gets the equal share.
func TestPlanDemandShare(t *testing.T) {
	dem := limit(t, "dem", `{rate: 10000, burst: 1000, share: demand, scope: nodes, match: {protocol: udp}}`)
	eq := limit(t, "eq", `{rate: 10000, burst: 1000, scope: nodes, match: {protocol: udp}}`)
	in := counted(4, dem, eq)
	in.demand = map[string]uint64{"dem": 7000, "eq": 7000}
	ds := plan(in)
	if d := byName(ds, "dem"); d.limit.Rate != 7000 || d.limit.Burst != 700 || d.meta.Scope != scopeNodes {
		t.Errorf("dem: %d/s burst %d scope %d, want 7000, 700, nodes", d.limit.Rate, d.limit.Burst, d.meta.Scope)
	}
	if d := byName(ds, "eq"); d.limit.Rate != 2500 || d.limit.Burst != 250 {
		t.Errorf("eq: %d/s burst %d, want the equal share 2500, 250", d.limit.Rate, d.limit.Burst)
	}
	in.demand = nil
	if d := mustPlan(t, in, "dem"); d.limit.Rate != 2500 {
		t.Errorf("dem before its first step: %d/s, want the equal share 2500", d.limit.Rate)
	}
}

// scope service: the Service's endpoints on this node are the local side
// of the match, and its share is weighted by them; with none here the
// limit is not planned at all (it would match every packet of the node).
func TestPlanServiceScope(t *testing.T) {
	ing := limit(t, "ing", `{rate: 9000, scope: service, attach: uplink, match: {protocol: tcp}}`)
	egr := limit(t, "egr", `{rate: 9000, scope: service, attach: uplink, match: {direction: egress, dstPorts: ["53"]}}`)
	gone := limit(t, "gone", `{rate: 9000, scope: service, attach: uplink}`)
	in := counted(6, ing, egr, gone)
	for _, n := range []string{"ing", "egr"} {
		in.obs[n] = watcher.Observation{Replicas: 6, Local: 2}
	}
	eps := serviceEndpoints{
		local: []watcher.Endpoint{{Addr: netip.MustParseAddr("10.0.0.7")}, {Addr: netip.MustParseAddr("fd00::7")}},
		ports: []watcher.EndpointPort{{Protocol: corev1.ProtocolTCP, Port: 8080}, {Protocol: corev1.ProtocolUDP, Port: 53}},
	}
	in.service = map[string]serviceEndpoints{"ing": eps, "egr": eps}
	ds := plan(in)
	if byName(ds, "gone") != nil {
		t.Error("a service limit without an endpoint here was planned")
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.0.0.7/32"), netip.MustParsePrefix("fd00::7/128")}
	d := byName(ds, "ing")
	if d.limit.Rate != 3000 || !slices.Equal(d.limit.Match.DstCIDRs, want) || d.limit.Match.SrcCIDRs != nil ||
		!slices.Equal(d.limit.Match.DstPorts, []maps.PortRange{{First: 8080, Last: 8080}}) || d.meta.Scope != scopeService || d.meta.Local != 2 {
		t.Errorf("ing: %+v meta %+v, want 3000/s to the endpoints' TCP port 8080", d.limit, d.meta)
	}
	d = byName(ds, "egr")
	if !slices.Equal(d.limit.Match.SrcCIDRs, want) || d.limit.Match.DstCIDRs != nil ||
		!slices.Equal(d.limit.Match.DstPorts, []maps.PortRange{{First: 53, Last: 53}}) {
		t.Errorf("egr: %+v, want from the endpoints to port 53", d.limit.Match)
	}
}

// scope pods: the matching pods' addresses on this node are the local side
// of the match (every port: pods name none), the share is weighted by the
// pods here of all that match, and the limit is at their interfaces by
// default (attach endpoints); with no matching pod here it is not planned.
func TestPlanPodsScope(t *testing.T) {
	web := limit(t, "web", `{rate: 9000, scope: pods, match: {protocol: udp, podSelector: {matchLabels: {app: web}}}}`)
	none := limit(t, "none", `{rate: 9000, scope: pods, match: {namespaceSelector: {}}}`)
	in := counted(1, web, none)
	in.obs["web"] = watcher.Observation{Replicas: 3, Local: 1}
	in.obs["none"] = watcher.Observation{Replicas: 5}
	pod := attach.Endpoint{Addr: netip.MustParseAddr("10.1.0.5"), Iface: "veth5", Ifindex: 5}
	in.service = map[string]serviceEndpoints{"web": {local: []watcher.Endpoint{{Addr: pod.Addr}}}}
	in.endpoints = endpointTable{addrs: map[netip.Addr]attach.Endpoint{pod.Addr: pod}}
	if addrs, _ := endpointQueries(in); !slices.Equal(addrs, []netip.Addr{pod.Addr}) {
		t.Errorf("endpoint queries %v, want the pod's address", addrs)
	}
	ds := plan(in)
	if byName(ds, "none") != nil {
		t.Error("a pods limit without a matching pod here was planned")
	}
	d := byName(ds, "web")
	if d == nil {
		t.Fatal("web not planned")
	}
	if d.limit.Rate != 3000 || !slices.Equal(d.limit.Match.DstCIDRs, []netip.Prefix{netip.MustParsePrefix("10.1.0.5/32")}) ||
		d.limit.Match.DstPorts != nil || d.meta.Scope != scopePods || d.meta.Local != 1 || d.meta.Replicas != 3 {
		t.Errorf("web: %+v meta %+v, want 3000/s to the pod, every port", d.limit, d.meta)
	}
	if len(d.points) != 1 || d.points[0].point.Iface != "veth5" || d.points[0].point.Kind != attach.TCEgress || d.atUplink != "" {
		t.Errorf("web placed at %+v (uplink: %q), want the pod's interface veth5, TC egress", d.points, d.atUplink)
	}
	if scopeName(scopePods) != "pods" {
		t.Errorf("scope code %d reads %q", scopePods, scopeName(scopePods))
	}
}

// attach endpoints: the hook of each endpoint's interface, or the uplink
// with the reason when the limit cannot run there.
func TestPlanEndpointPlacements(t *testing.T) {
	pod := attach.Endpoint{Addr: netip.MustParseAddr("10.1.0.5"), Iface: "veth5", Ifindex: 5,
		Peer: attach.Peer{Iface: "eth0", Netns: "/run/netns/p5"}}
	nopeer := attach.Endpoint{Addr: netip.MustParseAddr("10.1.0.6"), Iface: "veth6", Ifindex: 6,
		Peer: attach.Peer{Reason: "no namespace"}}
	host := attach.Endpoint{Addr: netip.MustParseAddr("10.1.0.9"), Reason: "a local address of this node"}
	table := endpointTable{
		addrs: map[netip.Addr]attach.Endpoint{pod.Addr: pod, nopeer.Addr: nopeer, host.Addr: host},
		in:    []attach.Endpoint{pod, nopeer, host},
	}
	hostSide := func(e attach.Endpoint, k attach.Kind) placement {
		h := maps.Endpoints.Hook(maps.Ingress)
		if k == attach.TCIngress {
			h = maps.Endpoints.Hook(maps.Egress)
		}
		return placement{hook: h, point: attach.Point{Iface: e.Iface, Kind: k}}
	}
	podSide := placement{hook: maps.Endpoints.Hook(maps.Ingress), point: attach.Point{Iface: "eth0", Netns: "/run/netns/p5", Kind: attach.TCIngress}}
	for _, tt := range []struct {
		name     string
		spec     string
		hook     v1alpha1.EndpointHook
		table    endpointTable
		want     []placement
		atUplink string // a part of the reason, "" when at the endpoints
		note     string
	}{
		{name: "ingress: the host side's egress", spec: `{attach: endpoints, match: {dstCIDRs: [10.1.0.5, 10.1.0.6]}}`,
			want: []placement{hostSide(pod, attach.TCEgress), hostSide(nopeer, attach.TCEgress)}},
		{name: "egress: the host side's ingress", spec: `{attach: endpoints, match: {direction: egress, srcCIDRs: [10.1.0.5]}}`,
			want: []placement{hostSide(pod, attach.TCIngress)}},
		{name: "endpointHook pod: the pod side, or the host side and a note", spec: `{attach: endpoints, match: {dstCIDRs: [10.1.0.5, 10.1.0.6]}}`,
			hook: v1alpha1.EndpointHookPod,
			want: []placement{podSide, hostSide(nopeer, attach.TCEgress)}, note: "the pod side of 10.1.0.6 (no namespace) not found"},
		{name: "a prefix: the endpoints inside it", spec: `{attach: endpoints, match: {dstCIDRs: [10.1.0.0/29]}}`,
			want: []placement{hostSide(pod, attach.TCEgress), hostSide(nopeer, attach.TCEgress)}},
		{name: "an endpoint without an interface", spec: `{attach: endpoints, match: {dstCIDRs: [10.1.0.5, 10.1.0.9]}}`,
			atUplink: "endpoint 10.1.0.9: a local address of this node"},
		{name: "no endpoint in the prefix", spec: `{attach: endpoints, match: {dstCIDRs: [10.2.0.0/16]}}`,
			atUplink: "no endpoint interface found in 10.2.0.0/16"},
		{name: "no endpoint addresses", spec: `{attach: endpoints, match: {srcCIDRs: [10.1.0.5]}}`,
			atUplink: "no endpoint addresses"},
		{name: "the lookup failed", spec: `{attach: endpoints, match: {dstCIDRs: [10.1.0.5]}}`,
			table:    endpointTable{addrsErr: errors.New("netlink: busy")},
			atUplink: "could not be looked up: netlink: busy"},
		{name: "an address not looked up", spec: `{attach: endpoints, match: {dstCIDRs: [10.1.0.77]}}`,
			atUplink: "endpoint 10.1.0.77: not looked up"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			l := limit(t, "l", tt.spec)
			l.Rate = 1000
			in := counted(1, l)
			in.endpointHook = tt.hook
			in.endpoints = table
			if tt.table.addrsErr != nil {
				in.endpoints = tt.table
			}
			d := mustPlan(t, in, "l")
			if tt.atUplink != "" {
				if d.points != nil || !strings.Contains(d.atUplink, tt.atUplink) || d.limit.Match.Attach != maps.Uplink ||
					!strings.Contains(d.note, tt.atUplink) {
					t.Errorf("points %v, attach %v, atUplink %q, note %q; want the uplink because %q", d.points, d.limit.Match.Attach, d.atUplink, d.note, tt.atUplink)
				}
				return
			}
			if !reflect.DeepEqual(d.points, tt.want) || d.atUplink != "" || d.limit.Match.Attach != maps.Endpoints {
				t.Errorf("points %+v attach %v atUplink %q, want %+v", d.points, d.limit.Match.Attach, d.atUplink, tt.want)
			}
			if !strings.Contains(d.note, tt.note) || (tt.note == "") != (d.note == "") {
				t.Errorf("note %q, want %q", d.note, tt.note)
			}
		})
	}
}

// endpointQueries asks for every address and prefix the plan will look
// up, configured and enforced versions alike, each once; nothing for
// limits at the uplink.
func TestEndpointQueries(t *testing.T) {
	a := limit(t, "a", `{rate: 1, attach: endpoints, match: {dstCIDRs: [10.1.0.5, 10.1.0.0/24]}}`)
	b := limit(t, "b", `{rate: 1, attach: endpoints, match: {direction: egress, srcCIDRs: [10.1.0.5, "fd00::1"]}}`)
	up := limit(t, "up", `{rate: 1, match: {dstCIDRs: [192.0.2.1]}}`)
	old := limit(t, "a", `{rate: 1, attach: endpoints, match: {dstCIDRs: [10.9.0.1]}}`)
	in := counted(1, a, b, up)
	in.enforced = map[string]*v1alpha1.Limit{"a": &old}
	addrs, wide := endpointQueries(in)
	wantAddrs := []netip.Addr{netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("10.9.0.1"), netip.MustParseAddr("fd00::1")}
	if !slices.Equal(addrs, wantAddrs) || !slices.Equal(wide, []netip.Prefix{netip.MustParsePrefix("10.1.0.0/24")}) {
		t.Errorf("queries %v %v, want %v and 10.1.0.0/24", addrs, wide, wantAddrs)
	}
}

// A changed limit carries its previous version divided by the current
// count: what stays enforced if the new one does not fit.
func TestPlanPreviousVersion(t *testing.T) {
	now := limit(t, "l", `{rate: 9000, match: {protocol: udp, srcCIDRs: [10.0.0.0/8]}}`)
	before := limit(t, "l", `{rate: 3000, match: {protocol: udp}}`)
	in := counted(3, now)
	if d := mustPlan(t, in, "l"); d.prev != nil {
		t.Errorf("no version before: prev %+v", d.prev)
	}
	in.enforced = map[string]*v1alpha1.Limit{"l": &before}
	d := mustPlan(t, in, "l")
	if d.prev == nil || d.prev.limit.Rate != 1000 || d.prev.limit.Match.SrcCIDRs != nil || d.prev.source != &before {
		t.Fatalf("prev %+v, want 3000/3 without the new prefix", d.prev)
	}
	if d.limit.Rate != 3000 {
		t.Errorf("the new version: %d/s, want 3000", d.limit.Rate)
	}
}
