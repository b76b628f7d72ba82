package e2e

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf/btf"

	"github.com/rlagent/rlagent/bpf"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// TestBpftoolMapDump: the README's tour promises that `bpftool map dump
// pinned <pinDir>/maps/rl_limits` shows the limits with named fields, from
// BTF, through the maps symlink of the current pin layout. With the tour's
// limit (dns, 20000 pkt/s) and count 4, the real bpftool, plain and -j, names
// every member of struct rl_limit (unit, key_kind and action by their enums'
// names), and the one live entry (gen != 0) is the
// limit's id with the share the agent wrote, 20000 / 4 = 5000 pkt/s and burst
// 2000 / 4 = 500, in params[active]; a new count shows in the next dump.
func TestBpftoolMapDump(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.HostOnly(t, "bpftool")
	bpftool := bpftoolPath(t)
	const rate = 20000 // the README's
	e := newEnv(t)
	e.writeCount(4)
	e.writeConfig(e.configYAML(rate, ""))
	e.startAgent()
	path := filepath.Join(e.pinDir, "maps", bpf.RatelimitMapRlLimits)

	members := rlLimitMembers(t)
	for _, count := range []int{4, 2} {
		changed := time.Now()
		e.writeCount(count)
		_, st := e.waitShare(rate/uint64(count), changed, 2*time.Second)

		// bpftool -j gives each entry's bytes and, with BTF, "formatted":
		// the key and value with the C names. The plain output the README
		// shows is the formatted part alone, also JSON.
		var dumpJ []struct {
			Formatted *limitEntry `json:"formatted"`
		}
		runBpftool(t, &dumpJ, bpftool, "-j", "map", "dump", "pinned", path)
		var dump []limitEntry
		runBpftool(t, &dump, bpftool, "map", "dump", "pinned", path)
		if len(dumpJ) != int(maps.MaxLimits) || len(dump) != int(maps.MaxLimits) {
			t.Fatalf("count %d: bpftool dumped %d entries (-j) and %d (plain), want %d each (an ARRAY of MaxLimits)",
				count, len(dumpJ), len(dump), maps.MaxLimits)
		}
		for i, d := range dumpJ {
			if d.Formatted == nil {
				t.Fatalf("count %d: bpftool -j entry %d has no \"formatted\" key and value: the map has no BTF", count, i)
			}
			if !equalJSON(*d.Formatted, dump[i]) {
				t.Errorf("count %d: entry %d: bpftool -j formats %s, plain bpftool %s", count, i, d.Formatted.Value, dump[i].Value)
			}
		}

		var live []limitEntry
		for _, d := range dump {
			var v map[string]json.RawMessage
			if err := json.Unmarshal(d.Value, &v); err != nil {
				t.Fatalf("count %d: entry %d's value %s: %v", count, d.Key, d.Value, err)
			}
			for _, m := range members {
				if _, ok := v[m]; !ok {
					t.Fatalf("count %d: entry %d's value %s lacks struct rl_limit's member %q", count, d.Key, d.Value, m)
				}
			}
			if d.limit(t).Gen != 0 {
				live = append(live, d)
			}
		}
		if len(live) != 1 {
			t.Fatalf("count %d: %d entries with gen != 0, want 1 (the limit %s)", count, len(live), limitName)
		}
		l := live[0].limit(t)
		t.Logf("count %d: bpftool: rl_limits[%d] = %s", count, live[0].Key, jsonString(live[0].Value))
		if live[0].Key != st.ID {
			t.Errorf("count %d: the live entry is rl_limits[%d], status says %s has id %d", count, live[0].Key, limitName, st.ID)
		}
		if l.Active > 1 {
			t.Fatalf("count %d: active = %d, want 0 or 1", count, l.Active)
		}
		p := l.Params[l.Active]
		wantRate, wantBurst := uint64(rate/count), uint64(rate/10/count)
		if p.Rate != wantRate || p.Burst != wantBurst {
			t.Errorf("count %d: params[active=%d] has rate %d, burst %d; want %d, %d (status: %d, %d)",
				count, l.Active, p.Rate, p.Burst, wantRate, wantBurst, st.ShareRate, st.ShareBurst)
		}
		// unit, key_kind and action are enums in BTF: bpftool prints
		// their names, not numbers.
		if l.Unit != "RL_UNIT_PACKETS" || l.Action != "RL_ACTION_DROP" || l.KeyKind != "RL_KEY_NONE" {
			t.Errorf("count %d: unit %q, action %q, key_kind %q; want RL_UNIT_PACKETS, RL_ACTION_DROP, RL_KEY_NONE",
				count, l.Unit, l.Action, l.KeyKind)
		}
	}
}

// limitEntry is one entry of bpftool's dump of rl_limits, as formatted
// from BTF: the key (the limit id) and the value, kept raw so that the
// test sees every name bpftool printed.
type limitEntry struct {
	Key   uint32          `json:"key"`
	Value json.RawMessage `json:"value"`
}

// limit decodes the members of struct rl_limit the test checks.
func (e limitEntry) limit(tb testing.TB) (l struct {
	Gen     uint32 `json:"gen"`
	Unit    string `json:"unit"`
	KeyKind string `json:"key_kind"`
	Action  string `json:"action"`
	Params  [2]struct {
		Rate  uint64 `json:"rate"`
		Burst uint64 `json:"burst"`
	} `json:"params"`
	Active uint32 `json:"active"`
}) {
	tb.Helper()
	if err := json.Unmarshal(e.Value, &l); err != nil {
		tb.Fatalf("rl_limits[%d] = %s: %v", e.Key, e.Value, err)
	}
	return l
}

func equalJSON(a, b limitEntry) bool {
	var va, vb any
	return a.Key == b.Key && json.Unmarshal(a.Value, &va) == nil && json.Unmarshal(b.Value, &vb) == nil &&
		jsonString(va) == jsonString(vb)
}

// jsonString is v encoded again: maps encode with sorted keys, so two
// values are equal when their strings are.
func jsonString(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// rlLimitMembers are the names of struct rl_limit's members in the data
// path's BTF: what bpftool must name.
func rlLimitMembers(tb testing.TB) []string {
	tb.Helper()
	spec, err := bpf.LoadRatelimit()
	if err != nil {
		tb.Fatal(err)
	}
	var s *btf.Struct
	if err := spec.Types.TypeByName("rl_limit", &s); err != nil {
		tb.Fatalf("struct rl_limit in the data path's BTF: %v", err)
	}
	var names []string
	for _, m := range s.Members {
		names = append(names, m.Name)
	}
	if !slices.Contains(names, "params") || !slices.Contains(names, "active") {
		tb.Fatalf("struct rl_limit has members %v: no params or active", names)
	}
	return names
}

// runBpftool runs bpftool with args and decodes its output into v.
func runBpftool(tb testing.TB, v any, bpftool string, args ...string) {
	tb.Helper()
	out, err := exec.Command(bpftool, args...).Output()
	if err != nil {
		var stderr []byte
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			stderr = ee.Stderr
		}
		tb.Fatalf("bpftool %v: %v\n%s", args, err, stderr)
	}
	if err := json.Unmarshal(out, v); err != nil {
		tb.Fatalf("bpftool %v: its output is not the JSON expected: %v\n%.2000s", args, err, out)
	}
}

// bpftoolPath finds bpftool, also where $PATH lacks the sbin folders
// (Debian installs it in /usr/sbin).
func bpftoolPath(tb testing.TB) string {
	tb.Helper()
	if p, err := exec.LookPath("bpftool"); err == nil {
		return p
	}
	for _, p := range []string{"/usr/sbin/bpftool", "/sbin/bpftool"} {
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p
		}
	}
	testenv.SkipOrFail(tb, "bpftool is missing: install the package bpftool (`make deps-test` does it)")
	return ""
}
