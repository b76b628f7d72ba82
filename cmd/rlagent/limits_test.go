package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// fileState is a file's bytes and modification time, and the names in its
// directory (a temporary file left behind would show there).
type fileState struct {
	data  []byte
	mtime time.Time
	dir   []string
}

func stateOf(t *testing.T, path string) fileState {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(filepath.Dir(path))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return fileState{data, fi.ModTime(), names}
}

func (s fileState) equal(o fileState) bool {
	return bytes.Equal(s.data, o.data) && s.mtime.Equal(o.mtime) && strings.Join(s.dir, "/") == strings.Join(o.dir, "/")
}

// oldConfig writes a config and dates it in the past, so that any write
// shows in its modification time.
func oldConfig(t *testing.T, content string) string {
	t.Helper()
	path := writeConfig(t, content)
	past := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
	if err := os.Chtimes(path, past, past); err != nil {
		t.Fatal(err)
	}
	return path
}

// limits set|delete --dry-run print the file they would write, which the
// agent loads, and write nothing: the file's bytes, its modification time
// and its directory stay as they were.
func TestLimitsDryRunWritesNothing(t *testing.T) {
	path := oldConfig(t, "interfaces: [eth0]\nmetricsAddress: \"off\"\nlimits:\n"+limitLines(2))
	before := stateOf(t, path)
	for _, tc := range []struct {
		args []string
		want []string // limit names in the printed file
	}{
		{[]string{"limits", "set", "web", "--rate", "100", "--protocol", "tcp", "--dst-ports", "80", "--dry-run"}, []string{"l0", "l1", "web"}},
		{[]string{"limits", "set", "l0", "--rate", "7", "--dry-run"}, []string{"l0", "l1"}},
		{[]string{"limits", "delete", "l1", "--dry-run"}, []string{"l0"}},
	} {
		r := rlagent(t, append(tc.args, "--config", path)...)
		if r.code != 0 {
			t.Errorf("%q: exit %d\n%s", tc.args, r.code, r.stderr)
			continue
		}
		if !strings.Contains(r.stderr, "dry run: "+path+" not written") {
			t.Errorf("%q: stderr %q does not say that nothing was written", tc.args, r.stderr)
		}
		c, err := v1alpha1.ParseConfig([]byte(r.stdout))
		if err != nil {
			t.Errorf("%q printed a file the agent does not load: %v\n%s", tc.args, err, r.stdout)
			continue
		}
		var got []string
		for _, l := range c.Limits {
			got = append(got, l.Name)
		}
		if strings.Join(got, ",") != strings.Join(tc.want, ",") {
			t.Errorf("%q printed limits %v, want %v", tc.args, got, tc.want)
		}
		if after := stateOf(t, path); !after.equal(before) {
			t.Fatalf("%q changed the config: before %v %q, after %v %q\n%s", tc.args, before.mtime, before.dir, after.mtime, after.dir, after.data)
		}
	}
	// A dry run of an invalid change fails like the change would.
	if r := rlagent(t, "limits", "set", "x", "--rate", "0", "--dry-run", "--config", path); r.code != 1 || !strings.Contains(r.stderr, "limits[2].rate") || r.stdout != "" {
		t.Errorf("an invalid dry run: exit %d, stdout %q, stderr %q; want 1, nothing, the field", r.code, r.stdout, r.stderr)
	}
	if after := stateOf(t, path); !after.equal(before) {
		t.Fatal("an invalid dry run changed the config")
	}
}

// limits set never writes a file the agent would reject, also when the
// file passes the config's own validation (v1alpha1.ParseConfig) but not
// the agent's checks against the data path: one limit more than the data
// path holds, more prefixes than its tables hold. A warning does not stop a
// change.
func TestLimitsSetNeverWritesWhatTheAgentRejects(t *testing.T) {
	full := "interfaces: [eth0]\nmetricsAddress: \"off\"\nlimits:\n" + limitLines(int(maps.MaxLimits))
	var cidrs []string
	for i := range 4097 {
		cidrs = append(cidrs, fmt.Sprintf("10.%d.%d.0/24", i/256, i%256))
	}
	for _, tc := range []struct {
		name    string
		content string
		args    []string
		want    string
	}{
		{"one limit too many", full, []string{"one-more", "--rate", "5"},
			fmt.Sprintf("limits: %d limits: the data path holds at most %d", maps.MaxLimits+1, maps.MaxLimits)},
		{"more prefixes than the table holds", "interfaces: [eth0]\n", []string{"wide", "--rate", "5", "--src-cidrs", strings.Join(cidrs, ",")},
			"limits[*].match.srcCIDRs: 4097 distinct IPv4 source prefixes over all limits: the data path holds at most 4096"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := oldConfig(t, tc.content)
			before := stateOf(t, path)
			r := rlagent(t, append([]string{"limits", "set", "--config", path}, tc.args...)...)
			if r.code != 1 || !strings.Contains(r.stderr, path+" unchanged: ") || !strings.Contains(r.stderr, tc.want) {
				t.Errorf("exit %d, stderr %.1000q: want 1 and %q", r.code, r.stderr, tc.want)
			}
			if after := stateOf(t, path); !after.equal(before) {
				t.Errorf("limits set wrote a file the agent rejects (%d bytes)", len(after.data))
			}
		})
	}

	// MaxMatch match-all limits, and one more: warned about, and written.
	var b strings.Builder
	b.WriteString("interfaces: [eth0]\nlimits:\n")
	for i := range maps.MaxMatch {
		fmt.Fprintf(&b, "  - {name: all-%d, rate: 1000, match: {}}\n", i)
	}
	path := oldConfig(t, b.String())
	r := rlagent(t, "limits", "set", "one-more", "--rate", "5", "--config", path)
	if r.code != 0 || !strings.Contains(r.stderr, "warning: ingress: one packet can match up to") || !strings.Contains(r.stderr, "one-more") {
		t.Errorf("exit %d, stderr %q: want 0 and a warning naming one-more", r.code, r.stderr)
	}
	if c, err := v1alpha1.LoadConfig(path); err != nil || len(c.Limits) != maps.MaxMatch+1 {
		t.Errorf("after the set: %v, want %d limits", err, maps.MaxMatch+1)
	}
}

// TestLimitsSetConcurrent: 20 runs of rlagent limits set at once, each a
// process of its own and each adding a limit, keep all 20 (the file is
// locked from the read to the write: before, they kept as few as one, all
// exiting 0), and the edits keep the file's mode and group (before, the
// group became the editor's).
func TestLimitsSetConcurrent(t *testing.T) {
	testenv.RequireRoot(t) // to give the file another group
	path := writeConfig(t, "interfaces: [eth0]\nmetricsAddress: \"off\"\n")
	if err := os.Chown(path, 0, 65534); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o640); err != nil {
		t.Fatal(err)
	}
	const n = 20
	var wg sync.WaitGroup
	results := make([]result, n)
	for i := range n {
		wg.Go(func() {
			results[i] = rlagent(t, "limits", "set", fmt.Sprintf("l%d", i), "--rate", "100",
				"--protocol", "udp", "--dst-ports", fmt.Sprint(1000+i), "--config", path)
		})
	}
	wg.Wait()
	for i, r := range results {
		if r.code != 0 {
			t.Errorf("run %d: exit %d, stderr %s", i, r.code, r.stderr)
		}
	}
	c, err := v1alpha1.LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Limits) != n {
		t.Errorf("%d limits after %d concurrent limits set, want %d: %s", len(c.Limits), n, n, names(c))
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	if fi.Mode().Perm() != 0o640 || st.Uid != 0 || st.Gid != 65534 {
		t.Errorf("file mode %v, owner %d, group %d; want -rw-r----- 0 65534 kept", fi.Mode().Perm(), st.Uid, st.Gid)
	}
}

// A selector that does not parse is an error that names its flag and shows
// the syntax, before anything is read or written. Scope pods without a
// selector, or a selector without scope pods, fails as the config's
// validation says, naming the field; the file is left as it was.
func TestLimitsSetSelectorErrors(t *testing.T) {
	path := oldConfig(t, "interfaces: [eth0]\nmetricsAddress: \"off\"\n")
	before := stateOf(t, path)
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"unclosed list", []string{"--scope", "pods", "--pod-selector", "tier in (a"},
			[]string{"--pod-selector: ", `"tier in (a"`, selectorSyntax}},
		{"no != in a LabelSelector", []string{"--scope", "pods", "--pod-selector", "app=web", "--namespace-selector", "env!=dev"},
			[]string{"--namespace-selector: ", `"!=" is not a valid label selector operator`, selectorSyntax}},
		{"bad label key", []string{"--scope", "pods", "--pod-selector", "-app=web"},
			[]string{"--pod-selector: ", selectorSyntax}},
		{"scope pods without a selector", []string{"--scope", "pods"},
			[]string{path + " unchanged: ", "limits[0].match.podSelector: required with scope pods"}},
		{"a selector without scope pods", []string{"--pod-selector", "!canary"},
			[]string{path + " unchanged: ", "limits[0].match.podSelector: only with scope pods"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rlagent(t, append([]string{"limits", "set", "web", "--rate", "100", "--config", path}, tc.args...)...)
			if r.code != 1 {
				t.Errorf("exit %d, want 1\n%s", r.code, r.stderr)
			}
			for _, w := range tc.want {
				if !strings.Contains(r.stderr, w) {
					t.Errorf("stderr %q does not say %q", r.stderr, w)
				}
			}
			if after := stateOf(t, path); !after.equal(before) {
				t.Errorf("the config changed:\n%s", after.data)
			}
		})
	}
}

// The MATCH column of limits list says which pods a limit chooses, in
// kubectl's syntax; a selector that chooses every pod reads so, not
// "<none>" as metav1.FormatLabelSelector would have it.
func TestMatchStringSelectors(t *testing.T) {
	web := &metav1.LabelSelector{
		MatchLabels: map[string]string{"app": "web"},
		MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "tier", Operator: metav1.LabelSelectorOpIn, Values: []string{"a", "b"}},
			{Key: "canary", Operator: metav1.LabelSelectorOpDoesNotExist},
		},
	}
	prod := &metav1.LabelSelector{MatchLabels: map[string]string{"env": "prod"}}
	for _, tc := range []struct {
		name string
		m    v1alpha1.Match
		want string
	}{
		{"pods", v1alpha1.Match{PodSelector: web}, "ingress tcp port 80 pods app=web,!canary,tier in (a,b)"},
		{"pods in namespaces", v1alpha1.Match{PodSelector: web, NamespaceSelector: prod}, "ingress tcp port 80 pods app=web,!canary,tier in (a,b) in namespaces env=prod"},
		{"every pod", v1alpha1.Match{PodSelector: &metav1.LabelSelector{}}, "ingress tcp port 80 pods (all)"},
		{"every pod in namespaces", v1alpha1.Match{NamespaceSelector: prod}, "ingress tcp port 80 pods (all) in namespaces env=prod"},
		{"no selector", v1alpha1.Match{}, "ingress tcp port 80"},
	} {
		tc.m.Direction, tc.m.Protocol, tc.m.DstPorts = v1alpha1.DirectionIngress, v1alpha1.ProtocolTCP, []string{"80"}
		if got := matchString(&tc.m); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
