package spec

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/limiter"
	"github.com/rlagent/rlagent/watcher/count"
)

// runSource runs src and returns a channel of what it applies.
func runSource(t *testing.T, src limiter.Source) <-chan []limiter.LimitConfig {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan []limiter.LimitConfig, 16)
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, func(c []limiter.LimitConfig) { ch <- c }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return ch
}

func next(t *testing.T, ch <-chan []limiter.LimitConfig) []limiter.LimitConfig {
	t.Helper()
	select {
	case c := <-ch:
		return c
	case <-time.After(5 * time.Second):
		t.Fatal("nothing applied in 5 s")
		return nil
	}
}

// TestFromLimits: limits in code are divided by the count as the agent
// divides them (rate / count, burst likewise, floor 1), with their policy.
func TestFromLimits(t *testing.T) {
	wait := &metav1.Duration{Duration: 250 * time.Millisecond}
	src, err := FromLimits(3,
		v1alpha1.Limit{Name: "per-source", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 300, Unit: v1alpha1.UnitRequests, Key: v1alpha1.KeySrcIP}},
		v1alpha1.Limit{Name: "sampler", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 10, Burst: ptr(uint64(2)), Unit: v1alpha1.UnitRequests,
			OnEmpty: v1alpha1.OnEmptyWait, MaxWait: wait, Action: v1alpha1.ActionShadow}},
	)
	if err != nil {
		t.Fatal(err)
	}
	got := next(t, runSource(t, src))
	want := []limiter.LimitConfig{
		{Name: "per-source", Rate: 100, Burst: 10, Keyed: true, OnEmpty: limiter.OnEmptyFail, GlobalRate: 300, GlobalBurst: 30, Replicas: 3},
		{Name: "sampler", Rate: 3, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: 250 * time.Millisecond, Shadow: true, GlobalRate: 10, GlobalBurst: 2, Replicas: 3},
	}
	if len(got) != len(want) {
		t.Fatalf("applied %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("applied[%d] = %+v, want %+v", i, got[i], want[i])
		}
	}
}

func ptr[T any](v T) *T { return &v }

// TestFromLimitsInvalid: an invalid limit is an error naming the field;
// a limit of packets is the agent's, not a process's.
func TestFromLimitsInvalid(t *testing.T) {
	for _, tt := range []struct {
		l    v1alpha1.Limit
		want string
	}{
		{v1alpha1.Limit{Name: "a", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 10}}, `limits[0].unit: "packets": this file holds the limits of a service's own processes`},
		{v1alpha1.Limit{Name: "a", RateLimitSpec: v1alpha1.RateLimitSpec{Unit: v1alpha1.UnitRequests}}, "limits[0].rate: required"},
		{v1alpha1.Limit{Name: "a", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 10, Unit: v1alpha1.UnitRequests, Key: v1alpha1.KeyDstPort}},
			`limits[0].key: "dst-port" is not one of none, src-ip, src-prefix, custom`},
		{v1alpha1.Limit{Name: "a", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 10, Unit: v1alpha1.UnitRequests, Scope: v1alpha1.ScopeService,
			Match: v1alpha1.Match{Service: "shop/api"}}}, "limits[0].scope: \"service\" needs the Kubernetes watcher"},
	} {
		_, err := FromLimits(1, tt.l)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("FromLimits(%+v) = %v, want %s", tt.l.RateLimitSpec, err, tt.want)
		}
	}
	if _, err := FromLimits(-1); err == nil {
		t.Error("FromLimits(-1) took a negative count")
	}
}

// TestFromFile: the file's count file is watched: a new count re-divides,
// and a broken file keeps the last count (its age grows).
func TestFromFile(t *testing.T) {
	dir := t.TempDir()
	countFile := filepath.Join(dir, "count")
	writeFile(t, countFile, "2\n")
	path := filepath.Join(dir, "limits.yaml")
	writeFile(t, path, "count:\n  file: "+countFile+"\nlimits:\n- name: api\n  unit: requests\n  rate: 300\n  onEmpty: wait\n  match: {}\n")
	src, err := FromFile(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	ch := runSource(t, src)
	if c := next(t, ch); len(c) != 1 || c[0].Rate != 150 || c[0].Replicas != 2 || c[0].MaxWait != v1alpha1.DefaultMaxWait {
		t.Fatalf("applied %+v, want api at 150/s over 2, maxWait %v", c, v1alpha1.DefaultMaxWait)
	}
	writeFile(t, countFile, "3\n")
	if c := next(t, ch); len(c) != 1 || c[0].Rate != 100 || c[0].Replicas != 3 {
		t.Fatalf("after count 3: applied %+v, want api at 100/s", c)
	}
	writeFile(t, countFile, "three\n")
	time.Sleep(600 * time.Millisecond) // three polls
	select {
	case c := <-ch:
		t.Fatalf("a malformed count file applied %+v: the last count stands", c)
	default:
	}
	if age := limiter.CountAger(src).CountAge("api"); age < 400*time.Millisecond {
		t.Errorf("count age %v after a malformed count file for 600 ms, want it growing", age)
	}
}

// TestFromFileErrors: a file is read strictly, and every problem names
// its field.
func TestFromFileErrors(t *testing.T) {
	dir := t.TempDir()
	for _, tt := range []struct{ body, want string }{
		{"limits:\n- name: api\n  unit: requests\n  rate: 10\n  burst: fast\n", "limits[0].burst"},
		{"limits:\n- name: api\n  rate: 10\n  match: {}\n", `limits[0].unit: "packets": this file holds the limits of a service's own processes`},
		{"limits:\n- name: api\n  unit: requests\n  rate: 10\n  match: {}\n- name: api\n  unit: requests\n  rate: 5\n  match: {}\n", `limits[1].name: "api" is already the name of limits[0]`},
		{"interfaces: [eth0]\n", "interfaces"},
		{"count: {static: 2, file: /c}\n", "count: set one of static, file, not both"},
	} {
		path := filepath.Join(dir, "limits.yaml")
		writeFile(t, path, tt.body)
		_, err := FromFile(path, nil)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("FromFile(%q) = %v, want %s", tt.body, err, tt.want)
		}
	}
	if _, err := FromFile(filepath.Join(dir, "none.yaml"), nil); err == nil {
		t.Error("FromFile of a missing file succeeded")
	}
}

// TestSpecSourceScopes: in a cluster, only the limits of scope service
// that name the process's own Service are its; the others are skipped
// (and logged), never enforced with a wrong count.
func TestSpecSourceScopes(t *testing.T) {
	limits := []v1alpha1.Limit{
		{Name: "mine", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 300, Unit: v1alpha1.UnitRequests, Scope: v1alpha1.ScopeService, Match: v1alpha1.Match{Service: "shop/api"}}},
		{Name: "other", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 300, Unit: v1alpha1.UnitRequests, Scope: v1alpha1.ScopeService, Match: v1alpha1.Match{Service: "shop/web"}}},
		{Name: "static", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 300, Unit: v1alpha1.UnitRequests, Scope: v1alpha1.ScopeStatic}},
		{Name: "packets", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 300, Scope: v1alpha1.ScopeService, Match: v1alpha1.Match{Service: "shop/api"}}},
		{Name: "broken", RateLimitSpec: v1alpha1.RateLimitSpec{Rate: 300, Unit: v1alpha1.UnitRequests, Scope: v1alpha1.ScopeService, Match: v1alpha1.Match{Service: "shop/api"}}},
	}
	for i := range limits {
		limits[i].Default()
	}
	s := &Source{
		Limits: func() ([]v1alpha1.Limit, map[string]error) {
			return limits, map[string]error{"broken": &v1alpha1.FieldError{Field: "spec.rate", Detail: "bad"}}
		},
		Count:   count.NewStatic(3),
		Service: "shop/api",
		Log:     discard(),
	}
	got := s.configs()
	if len(got) != 1 || got[0].Name != "mine" || got[0].Rate != 100 {
		t.Fatalf("configs = %+v, want only mine at 100/s", got)
	}
	for _, name := range []string{"other", "static", "broken"} {
		if s.skips[name] == "" {
			t.Errorf("%s: skipped without a reason", name)
		}
	}
	if _, ok := s.skips["packets"]; ok {
		t.Error("a limit of packets is the agent's, not a skip of this process")
	}
}

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }

// writeFile replaces path by rename, as a config tool would: a poll never
// sees it half written.
func writeFile(t *testing.T, path, body string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}
