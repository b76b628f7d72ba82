package cluster

import (
	"encoding/json"
	"fmt"
	"math"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/demand"
)

// longestKeys are n distinct keys of the longest form there is: IPv6
// networks /128 written without a "::".
func longestKeys(n int) []string {
	out := make([]string, n)
	for i := range out {
		a := [16]byte{0: 0xff, 1: 0xff, 2: 0xff, 3: 0xff, 4: 0xff, 5: 0xff, 6: 0xff, 7: 0xff, 8: 0xff, 9: 0xff, 10: 0xff, 11: 0xff, 12: 0xff, 13: 0xff}
		a[14], a[15] = byte(0x10+i>>8), byte(0x10+i)
		out[i] = netip.PrefixFrom(netip.AddrFrom16(a), 128).String()
		if len(out[i]) != v1alpha1.MaxKeyLength {
			panic(out[i])
		}
	}
	return out
}

// TestKeyedSizes: the bounds docs/kubernetes.md gives, at their worst (the
// longest keys, the largest numbers): one RateLimit's allocation with
// hotKeys' most keys under 32 KiB whatever the cluster's size, and one
// node's report with the most keys a node reports under 64 KiB.
func TestKeyedSizes(t *testing.T) {
	keys := longestKeys(v1alpha1.MaxHotKeys)
	var levels []demand.KeyLevel
	for _, k := range keys {
		levels = append(levels, demand.KeyLevel{Key: k, Level: demand.Level{Water: math.MaxUint64 - 1, Floor: math.MaxUint64}, Nodes: math.MaxInt32})
	}
	r := demand.Allocation{Round: math.MaxInt64, Level: demand.Level{Water: math.MaxUint64, Floor: math.MaxUint64}, Time: time.Now()}
	status := v1alpha1.RateLimitStatus{ObservedGeneration: math.MaxInt64, Replicas: math.MaxInt32,
		Allocation: allocationStatus(r, math.MaxInt32, math.MaxUint64, levels)}
	b, err := json.Marshal(status)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("a status with %d keys of %d bytes: %d bytes", len(keys), v1alpha1.MaxKeyLength, len(b))
	if len(b) > 32<<10-2<<10 {
		t.Errorf("a status with %d keys is %d bytes: want under 32 KiB with 2 KiB to spare for the condition", len(keys), len(b))
	}

	report := make(map[string]map[string]uint64)
	all := longestKeys(MaxReportKeys)
	for i, k := range all {
		name := fmt.Sprintf("limit-%02d-%s", i%4, "abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstu") // 63-byte names
		if report[name] == nil {
			report[name] = make(map[string]uint64)
		}
		report[name][k] = math.MaxUint64
	}
	b, err = json.Marshal(report)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("a report of %d keys: %d bytes", len(all), len(b))
	if len(b) >= 64<<10 {
		t.Errorf("a report of %d keys is %d bytes: want under 64 KiB", len(all), len(b))
	}
}

// TestCanonicalKeys: what the allocator takes of the nodes' reports of a
// keyed limit: only keys of the limit's kind, in the agents' form, a key
// written two ways once at its higher demand; another limit's keys and
// reports without keys untouched; the informer's maps never written.
func TestCanonicalKeys(t *testing.T) {
	l := v1alpha1.Limit{Name: "per-source", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 100, Key: v1alpha1.KeySrcIP}}
	l.Default()
	hostile := map[string]uint64{
		"10.0.0.1": 50, "::ffff:10.0.0.1": 70, // one key, two forms
		"2001:DB8::1": 30,
		"tcp/443":     90, "10.0.0.0/24": 90, "fe80::1%eth0": 90, "x": 90,
	}
	nodes := []demand.NodeReport{
		{Node: "a", Keys: map[string]map[string]uint64{"per-source": hostile, "other": {"x": 1}},
			PrevKeys: map[string]map[string]uint64{"per-source": {"10.0.0.9": 5}}},
		{Node: "b"},
	}
	got := canonicalKeys(nodes, &l)
	want := map[string]uint64{"10.0.0.1": 70, "2001:db8::1": 30}
	if !reflect.DeepEqual(got[0].Keys["per-source"], want) || len(got[0].Keys) != 1 {
		t.Errorf("node a's keys %v, want per-source %v alone", got[0].Keys, want)
	}
	if !reflect.DeepEqual(got[0].PrevKeys["per-source"], map[string]uint64{"10.0.0.9": 5}) {
		t.Errorf("node a's previous keys %v", got[0].PrevKeys)
	}
	if got[1].Keys != nil || got[1].PrevKeys != nil {
		t.Errorf("node b (no keys): %v, %v; want none", got[1].Keys, got[1].PrevKeys)
	}
	if len(hostile) != 7 || len(nodes[0].Keys) != 2 {
		t.Errorf("canonicalKeys wrote the reports it read")
	}
}
