package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// writeConfig writes a config file in a new directory and returns its path.
func writeConfig(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "rlagent.yaml")
	if err := os.WriteFile(path, []byte(content), 0o640); err != nil {
		t.Fatal(err)
	}
	return path
}

// limitLines is n limits named l0.. on distinct UDP ports.
func limitLines(n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "  - {name: l%d, rate: 1000, match: {protocol: udp, dstPorts: [\"%d\"]}}\n", i, 1000+i)
	}
	return b.String()
}

// rlagent validate: exit 0 and "valid" (with any warnings) for a file the
// agent loads; exit 1 with every problem listed, one a line, for one it
// rejects, including what the agent checks beyond the file's validation.
func TestValidate(t *testing.T) {
	const header = "interfaces: [eth0]\nmetricsAddress: \"off\"\nlimits:\n"
	matchAll := strings.Repeat("  - {name: all-NAME, rate: 1000, match: {}}\n", maps.MaxMatch+1)
	for i := range maps.MaxMatch + 1 {
		matchAll = strings.Replace(matchAll, "NAME", fmt.Sprint(i), 1)
	}
	for _, tc := range []struct {
		name    string
		content string
		code    int
		stdout  []string // substrings; the file's path is put before ": valid"
		stderr  []string
	}{
		{name: "valid", content: header + limitLines(3), code: 0, stdout: []string{": valid\n"}},
		{name: "valid with a warning", content: header + matchAll, code: 0,
			stdout: []string{": valid\n"},
			stderr: []string{fmt.Sprintf("warning: ingress: one packet can match up to %d limits, more than the %d", maps.MaxMatch+1, maps.MaxMatch), "all-0, all-1"}},
		{name: "every error", code: 1,
			content: "interfaces: [eth0]\nlimits:\n" +
				"  - {name: a, rate: 0, match: {}}\n" +
				"  - {name: b, rate: 10, unit: pkts, match: {dstPorts: [\"70000\"]}}\n" +
				limitLines(int(maps.MaxLimits)),
			stderr: []string{
				"4 errors:\n",
				"limits[0].rate: required",
				`limits[1].unit: "pkts" is not one of packets, bytes`,
				`limits[1].match.dstPorts[0]: "70000" is not a port`,
				fmt.Sprintf("limits: %d limits: the data path holds at most %d", maps.MaxLimits+2, maps.MaxLimits),
			}},
		{name: "what only the agent checks", code: 1, content: header + limitLines(int(maps.MaxLimits)+1),
			stderr: []string{fmt.Sprintf(": limits: %d limits: the data path holds at most %d\n", maps.MaxLimits+1, maps.MaxLimits)}},
		{name: "does not decode", code: 1, content: header + "  - {name: a, rate: 5, match: {dstPort: [\"53\"]}}\n",
			stderr: []string{"limits[0].match.dstPort: unknown field"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := writeConfig(t, tc.content)
			r := rlagent(t, "validate", "--config", path)
			if r.code != tc.code {
				t.Errorf("exit code %d, want %d\nstdout: %s\nstderr: %s", r.code, tc.code, r.stdout, r.stderr)
			}
			for _, s := range tc.stdout {
				if !strings.Contains(r.stdout, path+s) {
					t.Errorf("stdout does not say %q:\n%s", path+s, r.stdout)
				}
			}
			if tc.code != 0 && r.stdout != "" {
				t.Errorf("stdout %q for an invalid file, want nothing", r.stdout)
			}
			for _, s := range tc.stderr {
				if !strings.Contains(r.stderr, s) {
					t.Errorf("stderr does not say %q:\n%.2000s", s, r.stderr)
				}
			}
			if len(tc.stderr) == 0 && r.stderr != "" {
				t.Errorf("stderr %q, want nothing", r.stderr)
			}
		})
	}

	if r := rlagent(t, "validate", "--config", filepath.Join(t.TempDir(), "missing.yaml")); r.code != 1 || !strings.Contains(r.stderr, "no such file") {
		t.Errorf("a missing file: exit %d, stderr %q; want 1 and the cause", r.code, r.stderr)
	}
}

// TestLifelineWarning: validate and limits set warn (exit 0) about a limit
// that matches ingress TCP to SSH's port where the protect list does not
// exempt it (protect: []), and about one that names the port while the
// default rule exempts it; a file without protect gets the rule ssh, so a
// match-all limit there is not warned of.
func TestLifelineWarning(t *testing.T) {
	const header = "interfaces: [eth0]\nmetricsAddress: \"off\"\n"
	const cut = "matches TCP to local port 22 (ssh) and the protect list does not exempt it"
	for _, tc := range []struct {
		name, content, want string
	}{
		{"default list, match all", header + "limits:\n- {name: everything, rate: 1, match: {}}\n", ""},
		{"protect off, match all", header + "protect: []\nlimits:\n- {name: everything, rate: 1, match: {}}\n", "warning: limits[0] (everything): " + cut},
		{"protect off, tcp/22", header + "protect: []\nlimits:\n- {name: ssh, rate: 1, match: {protocol: tcp, dstPorts: [20-30]}}\n", "warning: limits[0] (ssh): " + cut},
		{"protect off, udp", header + "protect: []\nlimits:\n- {name: dns, rate: 1, match: {protocol: udp}}\n", ""},
		{"protect off, shadow", header + "protect: []\nlimits:\n- {name: all, rate: 1, action: shadow, match: {}}\n", ""},
		{"protect off, egress", header + "protect: []\nlimits:\n- {name: out, rate: 1, match: {direction: egress}}\n", ""},
		{"a list without ssh", header + "protect: [{name: web, protocol: tcp, localPorts: [443]}]\nlimits:\n- {name: everything, rate: 1, match: {}}\n", "warning: limits[0] (everything): " + cut},
		{"ssh only from one network", header + "protect: [{name: ssh, protocol: tcp, peers: [10.0.0.0/8], localPorts: [22]}]\nlimits:\n- {name: everything, rate: 1, match: {}}\n", cut},
		{"default list, names 22", header + "limits:\n- {name: brute, rate: 1, match: {protocol: tcp, dstPorts: [22]}}\n",
			"warning: limits[0] (brute): match.dstPorts covers TCP port 22, which the protect rule ssh exempts"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rlagent(t, "validate", "--config", writeConfig(t, tc.content))
			if r.code != 0 {
				t.Fatalf("exit %d, want 0; stderr %s", r.code, r.stderr)
			}
			if tc.want == "" && r.stderr != "" || !strings.Contains(r.stderr, tc.want) {
				t.Errorf("stderr %q, want %q", r.stderr, tc.want)
			}
		})
	}

	// limits set: the warning, exit 0, the change made, protect: [] kept.
	path := writeConfig(t, header+"protect: []\n")
	r := rlagent(t, "limits", "set", "everything", "--rate", "1", "--config", path)
	if r.code != 0 || !strings.Contains(r.stderr, "warning: limits[0] (everything): "+cut) {
		t.Errorf("limits set with protect []: exit %d, stderr %q; want 0 and the warning", r.code, r.stderr)
	}
	if data, _ := os.ReadFile(path); !strings.Contains(string(data), "protect: []\n") || !strings.Contains(string(data), "name: everything") {
		t.Errorf("limits set wrote\n%s\nwant the limit, and protect: [] kept", data)
	}
	// Without protect: no warning, and no protect written into the file.
	path = writeConfig(t, header)
	r = rlagent(t, "limits", "set", "everything", "--rate", "1", "--config", path)
	if r.code != 0 || r.stderr != "" {
		t.Errorf("limits set without protect: exit %d, stderr %q; want 0 and nothing", r.code, r.stderr)
	}
	if data, _ := os.ReadFile(path); strings.Contains(string(data), "protect") {
		t.Errorf("limits set wrote\n%s\nwant no protect (the default stays implicit)", data)
	}
}

// TestConfigNotRegular: validate and limits set refuse a config path that
// is a FIFO (with no writer: a plain read blocks forever) or a device
// (/dev/zero: a plain read never ends), at once, with exit 1 and the kind.
func TestConfigNotRegular(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "rlagent.yaml")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ path, kind string }{{fifo, "not a regular file (a FIFO)"}, {"/dev/zero", "not a regular file (a device)"}} {
		for _, args := range [][]string{
			{"validate", "--config", tc.path},
			{"limits", "set", "x", "--rate", "1", "--config", tc.path},
		} {
			r := rlagent(t, args...)
			if r.code != 1 || !strings.Contains(r.stderr, tc.kind) {
				t.Errorf("%q: exit %d, stderr %q; want 1 and %q", args, r.code, r.stderr, tc.kind)
			}
		}
	}
}
