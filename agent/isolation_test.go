package agent

import (
	"bytes"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/divide"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// Per-limit isolation: a limit that does not fit the data path is reported
// and skipped, and the others keep following their counts. On the code
// before it, one such limit failed every reconcile.

// logBuffer is a logger whose lines a test reads.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// count is how many lines hold every one of parts.
func (b *logBuffer) count(parts ...string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for line := range strings.SplitSeq(b.buf.String(), "\n") {
		all := line != ""
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			n++
		}
	}
	return n
}

// text is every line so far (for a test's message, while others may
// still write).
func (b *logBuffer) text() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func captureLog(a *Agent) *logBuffer {
	b := &logBuffer{}
	a.log = slog.New(slog.NewTextHandler(b, nil))
	a.ap.log = a.log
	return b
}

// setConfig replaces the agent's config, as a reload does.
func setConfig(tb testing.TB, a *Agent, cfg string) {
	tb.Helper()
	c, err := v1alpha1.ParseConfig([]byte(cfg))
	if err != nil {
		tb.Fatal(err)
	}
	a.cfg = c
}

// statusOf is the agent's status of the named limit, as the metrics read
// it (the pins, and the limits the agent holds no id for).
func statusOf(tb testing.TB, a *Agent, name string) (LimitStatus, bool) {
	tb.Helper()
	st, _, err := a.readStatus()
	if err != nil {
		tb.Fatal(err)
	}
	for _, s := range st {
		if s.Name == name {
			return s, true
		}
	}
	return LimitStatus{}, false
}

// stateMetric is the value of rlagent_limit_state{limit, state}.
func stateMetric(tb testing.TB, a *Agent, limit, state string) float64 {
	tb.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(&collector{read: a.readStatus})
	mfs, err := reg.Gather()
	if err != nil {
		tb.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "rlagent_limit_state" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["limit"] == limit && labels["state"] == state {
				return m.GetGauge().GetValue()
			}
		}
	}
	tb.Fatalf("no rlagent_limit_state{limit=%q,state=%q}", limit, state)
	return 0
}

// The data path's maximum node share is typed twice: in maps (from the C
// enum) and in api/v1alpha1, which bounds the global rate by it and cannot
// import maps.
func TestMaxRateAgrees(t *testing.T) {
	if v1alpha1.MaxHorizon != maps.MaxHorizon {
		t.Errorf("v1alpha1.MaxHorizon %v, maps.MaxHorizon (RL_MAX_HORIZON_NS) %v: make them equal", v1alpha1.MaxHorizon, maps.MaxHorizon)
	}
	if v1alpha1.MaxNodeRate != maps.MaxRate {
		t.Errorf("v1alpha1.MaxNodeRate %d, maps.MaxRate (RL_MAX_RATE) %d: make them equal (and the CRD's rate maximum)", uint64(v1alpha1.MaxNodeRate), maps.MaxRate)
	}
	if v1alpha1.MaxGlobalRate > maps.MaxRate {
		t.Errorf("v1alpha1.MaxGlobalRate %d is above what one node enforces, %d: a count of 1 could not be enforced", uint64(v1alpha1.MaxGlobalRate), maps.MaxRate)
	}
}

const threeLimits = `
interfaces: [lo]
limits:
- name: dns
  rate: 100000
  match: {protocol: udp, dstPorts: ["53"]}
- name: huge
  rate: 1000
  unit: bytes
  match: {protocol: tcp, dstPorts: ["443"]}
- name: web
  rate: 30000
  match: {protocol: tcp, dstPorts: ["80"]}
`

// A node share above the data path's range is clamped to it, enforced and
// reported (state, note, log once, metric); the other limits are installed
// and follow the count. (Validation bounds the global rate, so the test
// sets the rate behind its back, as a spec that skipped validation would.)
func TestReconcileClampsShareAboveRange(t *testing.T) {
	src := &fakeSource{}
	src.set(2)
	a := newTestAgent(t, threeLimits, src)
	logs := captureLog(a)
	huge := 5 * maps.MaxRate
	a.cfg.Limits[1].Rate = huge

	mustReconcile(t, a)
	mustReconcile(t, a) // nothing changed: nothing logged again
	for _, n := range []int{2, 3} {
		src.set(n)
		mustReconcile(t, a)
		if l := shareOf(t, a, "dns"); l.Rate != 100000/uint64(n) {
			t.Errorf("count %d: dns share %d, want %d", n, l.Rate, 100000/n)
		}
		if l := shareOf(t, a, "web"); l.Rate != 30000/uint64(n) {
			t.Errorf("count %d: web share %d, want %d", n, l.Rate, 30000/n)
		}
		l := shareOf(t, a, "huge")
		s, _ := statusOf(t, a, "huge")
		if want := huge / uint64(n); want > maps.MaxRate {
			if l.Rate != maps.MaxRate || s.State != "clamped" || !s.Enforced || !strings.Contains(s.Note, fmt.Sprint(maps.MaxRate)) {
				t.Errorf("count %d: huge share %d (state %s, note %q), want clamped to %d", n, l.Rate, s.State, s.Note, maps.MaxRate)
			}
			if v := stateMetric(t, a, "huge", "clamped"); v != 1 {
				t.Errorf("count %d: rlagent_limit_state{huge,clamped} = %v, want 1", n, v)
			}
		}
		if s, _ := statusOf(t, a, "dns"); s.State != "applied" || s.Note != "" {
			t.Errorf("count %d: dns state %s (%q), want applied", n, s.State, s.Note)
		}
	}
	if n := logs.count(`msg="limit clamped"`, "limit=huge"); n != 2 {
		// Once at count 2, once when the clamped share changed at count 3.
		t.Errorf("%d clamp log lines, want 2 (one per change):\n%s", n, logs.buf.String())
	}
	m, err := a.dp.Meta(idOf(t, a, "huge"))
	if err != nil {
		t.Fatal(err)
	}
	if m.State != maps.Clamped || !strings.Contains(m.Note, "clamped") {
		t.Errorf("pinned meta of huge: state %v note %q, want clamped", m.State, m.Note)
	}

	// Down to a share that fits: applied as configured again.
	src.set(6)
	mustReconcile(t, a)
	if l := shareOf(t, a, "huge"); l.Rate != huge/6 {
		t.Errorf("count 6: huge share %d, want %d", l.Rate, huge/6)
	}
	if s, _ := statusOf(t, a, "huge"); s.State != "applied" || s.Note != "" {
		t.Errorf("count 6: huge state %s (%q), want applied", s.State, s.Note)
	}
	if v := stateMetric(t, a, "huge", "clamped"); v != 0 {
		t.Errorf("count 6: rlagent_limit_state{huge,clamped} = %v, want 0", v)
	}
	if logs.count(`msg="limit applied as configured"`, "limit=huge") != 1 {
		t.Errorf("no log line says huge is applied as configured again:\n%s", logs.buf.String())
	}
}

// More limits than the data path holds: the ones that find no id (new
// limits take ids in name order) are rejected and reported, the others are
// enforced and follow the count. A limit added later never takes the place
// of one in the data path, and a rejected one takes a place that frees up.
func TestReconcileMoreLimitsThanTheDataPath(t *testing.T) {
	src := &fakeSource{}
	src.set(1)
	n := int(maps.MaxLimits) + 2
	a := newTestAgent(t, manyLimits(n), src)
	logs := captureLog(a)
	mustReconcile(t, a)

	names := make([]string, n)
	for i := range n {
		names[i] = fmt.Sprintf("l%d", i)
	}
	slices.Sort(names)
	rejected := names[maps.MaxLimits:]
	check := func(what string, count int, rejected []string) {
		t.Helper()
		if got := len(a.dp.IDs()); got != int(maps.MaxLimits) {
			t.Errorf("%s: %d limits in the data path, want %d", what, got, maps.MaxLimits)
		}
		for i := range n {
			name := fmt.Sprintf("l%d", i)
			s, ok := statusOf(t, a, name)
			if slices.Contains(rejected, name) {
				if !ok || s.State != "rejected" || s.Enforced || !strings.Contains(s.Note, fmt.Sprint(maps.MaxLimits)) {
					t.Errorf("%s: %s: %+v, want rejected with a note naming %d", what, name, s, maps.MaxLimits)
				}
				continue
			}
			if want := uint64(10000+i) / uint64(count); !ok || s.State != "applied" || s.ShareRate != want {
				t.Errorf("%s: %s: state %s share %d, want applied at %d", what, name, s.State, s.ShareRate, want)
			}
		}
	}
	check("130 limits", 1, rejected)
	for _, name := range rejected {
		if logs.count(`msg="limit not applied"`, "limit="+name+" ") != 1 {
			t.Errorf("no single log line says %s is not applied:\n%s", name, logs.buf.String())
		}
		if v := stateMetric(t, a, name, "rejected"); v != 1 {
			t.Errorf("rlagent_limit_state{%s,rejected} = %v, want 1", name, v)
		}
	}
	src.set(4)
	mustReconcile(t, a)
	check("count 4", 4, rejected)

	// A new limit that sorts first takes no place from a limit in the
	// data path.
	setConfig(t, a, manyLimits(n)+"- name: a-new\n  rate: 100\n  match: {protocol: udp, dstPorts: [\"9\"]}\n")
	mustReconcile(t, a)
	check("a-new added", 4, append(slices.Clone(rejected), "a-new"))

	// Three limits go: the three rejected ones take their places, in name
	// order (a-new first).
	var b strings.Builder
	b.WriteString("interfaces: [lo]\nlimits:\n- name: a-new\n  rate: 100\n  match: {protocol: udp, dstPorts: [\"9\"]}\n")
	for i := 3; i < n; i++ {
		fmt.Fprintf(&b, "- name: l%d\n  rate: %d\n  match: {protocol: udp, dstPorts: [\"%d\"]}\n", i, 10000+i, 1000+i)
	}
	setConfig(t, a, b.String())
	mustReconcile(t, a)
	for _, name := range append(slices.Clone(rejected), "a-new") {
		if s, ok := statusOf(t, a, name); !ok || s.State != "applied" || !s.Enforced {
			t.Errorf("after three removals: %s: %+v, want applied", name, s)
		}
	}
	if got := len(a.dp.IDs()); got != int(maps.MaxLimits) {
		t.Errorf("after three removals: %d limits in the data path, want %d", got, maps.MaxLimits)
	}
}

// prefixLimit is a limit of n distinct IPv4 source addresses, from first.
func prefixLimit(b *strings.Builder, name string, rate, first, n int) {
	fmt.Fprintf(b, "- name: %s\n  rate: %d\n  match:\n    protocol: udp\n    srcCIDRs: [", name, rate)
	for i := range n {
		if i > 0 {
			b.WriteString(", ")
		}
		a := first + i
		fmt.Fprintf(b, "10.%d.%d.%d", a>>16&255, a>>8&255, a&255)
	}
	b.WriteString("]\n")
}

// prefixConfig is a config of limits, each {name, rate, first, n}.
func prefixConfig(limits ...[4]any) string {
	var b strings.Builder
	b.WriteString("interfaces: [lo]\nlimits:\n")
	for _, l := range limits {
		prefixLimit(&b, l[0].(string), l[1].(int), l[2].(int), l[3].(int))
	}
	return b.String()
}

// srcTable is the size of the data path's IPv4 source prefix table.
const srcTable = 4096

// More source prefixes than the data path's table holds: the limit that
// overflows it, in the order limits claim room, is rejected; the others
// are enforced and follow the count. A new version of an installed limit
// that does not fit leaves the previous version enforced (and following
// the count); it is applied once room frees up. A rejected limit removed
// from the config leaves no metadata behind.
func TestReconcilePrefixTableOverflow(t *testing.T) {
	src := &fakeSource{}
	src.set(1)
	a := newTestAgent(t, prefixConfig(
		[4]any{"aa", 3000, 0, 3000},
		[4]any{"bb", 1500, 10000, 1500}, // 4500 with aa: over the table
		[4]any{"cc", 600, 20000, 10},
	), src)
	logs := captureLog(a)
	mustReconcile(t, a)
	want := func(what, name, state string, enforced bool, share uint64, nCIDRs int) {
		t.Helper()
		s, ok := statusOf(t, a, name)
		if !ok || s.State != state || s.Enforced != enforced {
			t.Errorf("%s: %s: state %s enforced %v (note %q), want %s, enforced %v", what, name, s.State, s.Enforced, s.Note, state, enforced)
			return
		}
		if !enforced {
			return
		}
		l := shareOf(t, a, name)
		if l.Rate != share || len(l.Match.SrcCIDRs) != nCIDRs {
			t.Errorf("%s: %s: share %d with %d prefixes, want %d with %d", what, name, l.Rate, len(l.Match.SrcCIDRs), share, nCIDRs)
		}
	}
	want("start", "aa", "applied", true, 3000, 3000)
	want("start", "bb", "rejected", false, 0, 0)
	want("start", "cc", "applied", true, 600, 10)
	if s, _ := statusOf(t, a, "bb"); !strings.Contains(s.Note, "table full") || !strings.Contains(s.Note, "prefixes") {
		t.Errorf("bb's note %q does not say which table is full", s.Note)
	}
	src.set(3)
	mustReconcile(t, a)
	want("count 3", "aa", "applied", true, 1000, 3000)
	want("count 3", "bb", "rejected", false, 0, 0)
	want("count 3", "cc", "applied", true, 200, 10)

	// cc grows past the table and changes its rate: nothing of the new
	// version is applied, the previous one stays and follows the count.
	setConfig(t, a, prefixConfig(
		[4]any{"aa", 3000, 0, 3000},
		[4]any{"bb", 1500, 10000, 1500},
		[4]any{"cc", 900, 20000, 2000},
	))
	mustReconcile(t, a)
	want("cc grown", "cc", "rejected", true, 200, 10)
	if s, _ := statusOf(t, a, "cc"); !strings.Contains(s.Note, "previous") {
		t.Errorf("cc's note %q does not say the previous version stays", s.Note)
	}
	if logs.count("previous version stays enforced", "limit=cc") != 1 {
		t.Errorf("no single log line says cc's previous version stays:\n%s", logs.buf.String())
	}
	src.set(2)
	mustReconcile(t, a)
	want("cc grown, count 2", "cc", "rejected", true, 300, 10)
	want("cc grown, count 2", "aa", "applied", true, 1500, 3000)

	// bb, rejected, goes: its metadata goes with it.
	bbID := idOf(t, a, "bb") // rejected, it holds an id: status shows it from the pins
	setConfig(t, a, prefixConfig(
		[4]any{"aa", 3000, 0, 3000},
		[4]any{"cc", 900, 20000, 2000},
	))
	mustReconcile(t, a)
	if _, ok := statusOf(t, a, "bb"); ok {
		t.Error("bb, removed from the config, still in status")
	}
	ids, err := a.dp.MetaIDs()
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(ids, bbID) {
		t.Errorf("bb's metadata (id %d) left behind after its removal", bbID)
	}
	want("bb removed", "cc", "rejected", true, 300, 10) // 3000 + 2000 is still over

	// aa goes: cc's new version fits and is applied.
	setConfig(t, a, prefixConfig([4]any{"cc", 900, 20000, 2000}))
	mustReconcile(t, a)
	want("aa removed", "cc", "applied", true, 450, 2000)
}

// A limit that grows into room another frees in the same pass is applied,
// whatever their ids: changes that free room go first.
func TestReconcileShrinkBeforeGrow(t *testing.T) {
	src := &fakeSource{}
	src.set(1)
	a := newTestAgent(t, prefixConfig(
		[4]any{"aa", 100, 0, 1000},
		[4]any{"bb", 100, 10000, 3000},
	), src)
	mustReconcile(t, a)
	if idOf(t, a, "aa") >= idOf(t, a, "bb") {
		t.Fatalf("ids aa %d, bb %d: the test needs aa first", idOf(t, a, "aa"), idOf(t, a, "bb"))
	}
	// aa (first by id) grows by 1000, bb shrinks by 1000: 4000 in the end,
	// but 5000 if aa were written first.
	setConfig(t, a, prefixConfig(
		[4]any{"aa", 100, 0, 2000},
		[4]any{"bb", 100, 10000, 2000},
	))
	mustReconcile(t, a)
	for _, name := range []string{"aa", "bb"} {
		if s, _ := statusOf(t, a, name); s.State != "applied" || len(shareOf(t, a, name).Match.SrcCIDRs) != 2000 {
			t.Errorf("%s: state %s (%q), %d prefixes, want applied with 2000", name, s.State, s.Note, len(shareOf(t, a, name).Match.SrcCIDRs))
		}
	}
}

// `rlagent status` reads the pins: it lists a rejected limit with its
// state and note while the agent is down, and an agent that starts on
// those pins finds its id.
func TestStatusShowsRejectedFromPins(t *testing.T) {
	testenv.RequireRoot(t)
	dir := testenv.BPFFS(t)
	src := &fakeSource{}
	src.set(1)
	a := newTestAgent(t, prefixConfig(
		[4]any{"aa", 3000, 0, 3000},
		[4]any{"bb", 1500, 10000, 1500},
	), src)
	dp, err := maps.Load(maps.Options{PinDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	a.dp.Close()
	a.dp, a.ap.store = dp, dp
	mustReconcile(t, a)
	bbID := idOf(t, a, "bb")
	dp.Close()

	st, err := ReadStatus(dir)
	if err != nil {
		t.Fatal(err)
	}
	var bb *LimitStatus
	for i := range st {
		if st[i].Name == "bb" {
			bb = &st[i]
		}
	}
	if len(st) != 2 || bb == nil {
		t.Fatalf("status lists %d limits (%v), want aa and the rejected bb", len(st), st)
	}
	if bb.State != "rejected" || bb.Enforced || bb.ShareRate != 0 || bb.GlobalRate != 1500 || !strings.Contains(bb.Note, "table full") {
		t.Errorf("bb in status: %+v, want rejected, not enforced, global rate 1500, a note saying why", *bb)
	}

	dp2, err := maps.Load(maps.Options{PinDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer dp2.Close()
	metas, err := dp2.Metas()
	if err != nil {
		t.Fatal(err)
	}
	if m, ok := metas[bbID]; !ok || m.Name != "bb" || len(metas) != 2 {
		t.Errorf("the pins' metadata %v, want aa's and bb's (id %d)", metas, bbID)
	}
}

// Defaults live in RateLimitSpec.Default alone: the data path's limit of a
// spec left empty is the one of its defaulted copy, and a value neither
// set nor defaulted is an error, never a silent "any" (the code before
// turned an unknown protocol into a match of every protocol).
func TestToMapsLimitDefaultsInOnePlace(t *testing.T) {
	share := divide.Share{Rate: 100, Burst: 10}
	for _, spec := range []v1alpha1.RateLimitSpec{
		{Rate: 100},
		{Rate: 100, Key: v1alpha1.KeySrcPrefix},
		{Rate: 100, Key: v1alpha1.KeySrcPrefix, PrefixLength: &v1alpha1.PrefixLength{IPv4: 16}},
		{Rate: 100, Key: v1alpha1.KeySrcPrefix, PrefixLength: &v1alpha1.PrefixLength{IPv6: 48}},
		{Rate: 100, Unit: v1alpha1.UnitBytes, Match: v1alpha1.Match{Protocol: v1alpha1.ProtocolTCP, DstPorts: []string{"80"}}},
	} {
		defaulted := spec.DeepCopy()
		defaulted.Default()
		before := spec.DeepCopy()
		got, err := toMapsLimit(&spec, share)
		if !reflect.DeepEqual(before, &spec) {
			t.Errorf("toMapsLimit changed its input: %+v, was %+v", spec, *before)
		}
		if err != nil {
			t.Errorf("%+v: %v", spec, err)
			continue
		}
		want, err := toMapsLimit(defaulted, share)
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("%+v: %+v, its defaulted copy %+v", spec, got, want)
		}
		if spec.Key == v1alpha1.KeySrcPrefix && (got.Prefix4 != defaulted.PrefixLength.IPv4 || got.Prefix6 != defaulted.PrefixLength.IPv6) {
			t.Errorf("%+v: prefix lengths %d/%d, Default says %d/%d", spec, got.Prefix4, got.Prefix6, defaulted.PrefixLength.IPv4, defaulted.PrefixLength.IPv6)
		}
	}
	for _, spec := range []v1alpha1.RateLimitSpec{
		{Rate: 100, Match: v1alpha1.Match{Protocol: "sctp"}},
		{Rate: 100, Match: v1alpha1.Match{Direction: "sideways"}},
		{Rate: 100, Unit: "pkts"},
	} {
		if l, err := toMapsLimit(&spec, share); err == nil {
			t.Errorf("%+v: converted to %+v, want an error", spec, l)
		}
	}
}

// A clamped share is clamped at the data path's maximum, burst included.
func TestShareFit(t *testing.T) {
	s, note := fit(divide.Share{Rate: maps.MaxRate + 1, Burst: maps.MaxBurstSeconds * (maps.MaxRate + 1)})
	if s.Rate != maps.MaxRate || s.Burst != maps.MaxBurstSeconds*maps.MaxRate || note == "" {
		t.Errorf("fit: %+v %q", s, note)
	}
	if s, note := fit(divide.Share{Rate: maps.MaxRate, Burst: 5}); s.Rate != maps.MaxRate || s.Burst != 5 || note != "" {
		t.Errorf("fit of a share in range: %+v %q", s, note)
	}
}

// The uplinks' fq is sized for the paced limits: a horizon of twice the
// longest, a flow limit of a horizon of the largest share in packets (64
// bytes a packet for a bytes limit), never below fq's 100; nothing without
// a paced limit.
func TestPacingFQ(t *testing.T) {
	drop := maps.Limit{Rate: 1e6, Burst: 1e5}
	pktsPaced := maps.Limit{Rate: 50_000, Burst: 100, Action: maps.Pace, Horizon: 100 * time.Millisecond}
	bytesPaced := maps.Limit{Rate: 12_800_000, Burst: 1 << 20, Unit: maps.Bytes, Action: maps.Pace, Horizon: 250 * time.Millisecond}
	slow := maps.Limit{Rate: 10, Burst: 1, Action: maps.Pace, Horizon: 50 * time.Millisecond}
	for _, tc := range []struct {
		name   string
		limits []maps.Limit
		paced  bool
		want   attach.FQ
	}{
		{"no paced limit", []maps.Limit{drop}, false, attach.FQ{}},
		{"packets", []maps.Limit{drop, pktsPaced}, true, attach.FQ{Horizon: 200 * time.Millisecond, FlowLimit: 5000}},
		{"bytes", []maps.Limit{bytesPaced}, true, attach.FQ{Horizon: 500 * time.Millisecond, FlowLimit: 50_000}},
		{"the largest of each", []maps.Limit{pktsPaced, bytesPaced, slow}, true, attach.FQ{Horizon: 500 * time.Millisecond, FlowLimit: 50_000}},
		{"fq's default at least", []maps.Limit{slow}, true, attach.FQ{Horizon: 100 * time.Millisecond, FlowLimit: 100}},
	} {
		if paced, fq := pacing(tc.limits); paced != tc.paced || fq != tc.want {
			t.Errorf("%s: pacing = %v, %+v; want %v, %+v", tc.name, paced, fq, tc.paced, tc.want)
		}
	}
}
