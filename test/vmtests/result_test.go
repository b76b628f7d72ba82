package vmtests

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestReportRoundTrip(t *testing.T) {
	var r Report
	lines := []string{
		"SeaBIOS (version 1.16.2-debian-1.16.2-1)",
		// SeaBIOS clears the screen before the kernel starts: the escape
		// sequences end up in front of the first line.
		"\x1bc\x1b[?7l\x1b[2J" + BootLine("6.1.0-57-cloud-amd64", 2080*time.Millisecond),
		"=== RUN   TestX",
		"--- PASS: TestX (0.00s)",
		SuiteLine("bpf.test", 0, 87500*time.Millisecond),
		"[   12.3] veth: some kernel message " + SuiteLine("e2e.test", 1, 52*time.Second) + "\r",
		DoneLine(1),
	}
	for _, l := range lines {
		if _, err := r.Parse(l); err != nil {
			t.Fatal(err)
		}
	}
	want := Report{
		Kernel: "6.1.0-57-cloud-amd64", Boot: 2080 * time.Millisecond, Done: true, Status: 1,
		Suites: []SuiteResult{{"bpf.test", 0, 87500 * time.Millisecond}, {"e2e.test", 1, 52 * time.Second}},
	}
	if r.Kernel != want.Kernel || r.Boot != want.Boot || r.Done != want.Done || r.Status != want.Status || len(r.Suites) != 2 ||
		r.Suites[0] != want.Suites[0] || r.Suites[1] != want.Suites[1] {
		t.Errorf("got %+v\nwant %+v", r, want)
	}
	if r.Passed() {
		t.Error("Passed() with a failed suite")
	}
}

func TestReportPassed(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lines []string
		want  bool
	}{
		{"all passed", []string{SuiteLine("a", 0, time.Second), DoneLine(0)}, true},
		{"no suites, done 0", []string{DoneLine(0)}, true},
		{"no done line", []string{SuiteLine("a", 0, time.Second)}, false},
		{"nothing at all", nil, false},
		{"setup failed", []string{SuiteLine("a", 0, time.Second), DoneLine(1)}, false},
		{"a suite failed, done 0", []string{SuiteLine("a", 2, time.Second), DoneLine(0)}, false},
		{"killed by a signal", []string{SuiteLine("a", 137, time.Second), DoneLine(1)}, false},
	} {
		var r Report
		for _, l := range tc.lines {
			if ok, err := r.Parse(l); !ok || err != nil {
				t.Fatalf("%s: Parse(%q) = %v, %v", tc.name, l, ok, err)
			}
		}
		if got := r.Passed(); got != tc.want {
			t.Errorf("%s: Passed() = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestReportParseErrors(t *testing.T) {
	for _, line := range []string{
		"@@vmtest ",
		"@@vmtest reboot now=1",
		"@@vmtest done",
		"@@vmtest done status=x",
		"@@vmtest done status",
		"@@vmtest suite name=a status=0",
		"@@vmtest suite name=a status=0 seconds=-1",
		"@@vmtest boot kernel=6.1",
	} {
		var r Report
		ok, err := r.Parse(line)
		if !ok || err == nil {
			t.Errorf("Parse(%q) = %v, %v; want a report line with an error", line, ok, err)
		}
		if r.Done {
			t.Errorf("Parse(%q) marked the report done", line)
		}
	}
	var r Report
	for _, line := range []string{"", "PASS", "ok  \tgithub.com/x 1.2s", "vmtest done status=0", "@@vmtes done status=0"} {
		if ok, err := r.Parse(line); ok || err != nil {
			t.Errorf("Parse(%q) = %v, %v; want not a report line", line, ok, err)
		}
	}
	if !strings.HasPrefix(DoneLine(0), marker) {
		t.Errorf("DoneLine does not start with the marker")
	}
}

func TestCleanConsole(t *testing.T) {
	for in, want := range map[string]string{
		"\x1bc\x1b[?7l\x1b[2JSeaBIOS (version 1.16.2)": "SeaBIOS (version 1.16.2)",
		"PASS\r":                "PASS",
		"a\x1b[0mb\x1b[1;31mc":  "abc",
		"plain":                 "plain",
		"trailing escape \x1b[": "trailing escape ",
	} {
		if got := CleanConsole(in); got != want {
			t.Errorf("CleanConsole(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestReportFailures(t *testing.T) {
	var r Report
	for _, l := range []string{
		"=== RUN   TestA",
		"    a_test.go:10: passing detail",
		"--- PASS: TestA (1.00s)",
		"=== RUN   TestB",
		"=== RUN   TestB/ipv4",
		"    b_test.go:20: offered 800",
		"[   12.3] a kernel message",
		"    b_test.go:21: received 500, want 400",
		"--- FAIL: TestB (2.00s)",
		"    --- FAIL: TestB/ipv4 (1.00s)",
		// The suite's tests' failures were seen: it adds nothing.
		SuiteLine("bpf.test", 1, time.Second),
		"=== RUN   TestC",
		"panic: runtime error: index out of range",
		"FAIL",
	} {
		if _, err := r.Parse(l); err != nil {
			t.Fatal(err)
		}
	}
	if len(r.Failures) != 2 {
		t.Fatalf("failures %+v, want TestB and TestB/ipv4", r.Failures)
	}
	if f := r.Failures[0]; f.Test != "TestB" || strings.Join(f.Lines, "|") != "b_test.go:20: offered 800|b_test.go:21: received 500, want 400" {
		t.Errorf("first failure %+v", f)
	}
	if f := r.Failures[1]; f.Test != "TestB/ipv4" || len(f.Lines) != 0 {
		t.Errorf("second failure %+v", f)
	}
	// A panic ends the binary without a --- FAIL line: the suite's
	// failure carries it.
	r.Parse(SuiteLine("e2e.test", 2, time.Second))
	if len(r.Failures) != 3 || r.Failures[2].Test != "e2e.test (exit 2)" || strings.Join(r.Failures[2].Lines, "|") != "panic: runtime error: index out of range" {
		t.Fatalf("after the panic: %+v", r.Failures)
	}
	for i := 0; i < 2*maxFailureLines; i++ {
		r.Parse("    c_test.go:1: " + strings.Repeat("x", 2*maxLineLen))
	}
	r.Parse("--- FAIL: TestC (0.1s)")
	if f := r.Failures[3]; len(f.Lines) != maxFailureLines || len(f.Lines[0]) != maxLineLen+3 {
		t.Errorf("TestC kept %d lines of %d bytes, want %d of %d", len(f.Lines), len(f.Lines[0]), maxFailureLines, maxLineLen+3)
	}
}

func TestRerunTests(t *testing.T) {
	for _, c := range []struct {
		name     string
		failures []string
		want     string // RunPattern of the tests, or "" for no rerun
	}{
		{"none", nil, ""},
		{"subtests of one test", []string{"TestB", "TestB/ipv4", "TestB/ipv6"}, "^(TestB)$"},
		{"two tests", []string{"TestB/ipv4", "TestA.x"}, `^(TestB|TestA\.x)$`},
		{"as many as allowed", []string{"TestA", "TestB", "TestC"}, "^(TestA|TestB|TestC)$"},
		{"one too many", []string{"TestA", "TestB", "TestC", "TestD"}, ""},
		{"a panic or a timeout", []string{"TestA", "e2e.test (exit 2)"}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			var fs []Failure
			for _, f := range c.failures {
				fs = append(fs, Failure{Test: f})
			}
			got := RerunTests(fs)
			if c.want == "" {
				if got != nil {
					t.Errorf("RerunTests(%v) = %v, want no rerun", c.failures, got)
				}
				return
			}
			if p := RunPattern(got); p != c.want {
				t.Errorf("RunPattern(RerunTests(%v)) = %q, want %q", c.failures, p, c.want)
			}
		})
	}
	// As many failures as a report keeps: there may have been more.
	full := make([]Failure, maxFailures)
	for i := range full {
		full[i] = Failure{Test: "TestA/case"}
	}
	if got := RerunTests(full); got != nil {
		t.Errorf("RerunTests of %d failures (the most a report keeps) = %v, want no rerun", maxFailures, got)
	}
}

func TestReportRerun(t *testing.T) {
	var r Report
	for _, l := range []string{
		BootLine("6.1.0-1-cloud-amd64", time.Second),
		"--- FAIL: TestB (2.00s)",
		RerunLine("e2e.test", []string{"TestB", "TestC"}, 0),
		SuiteLine("e2e.test", 0, time.Second),
		DoneLine(0),
	} {
		if _, err := r.Parse(l); err != nil {
			t.Fatal(err)
		}
	}
	if !r.Passed() {
		t.Errorf("a suite whose failed tests passed their rerun did not pass: %+v", r)
	}
	want := []Rerun{{Suite: "e2e.test", Tests: []string{"TestB", "TestC"}, Status: 0}}
	if !reflect.DeepEqual(r.Reruns, want) || len(r.Failures) != 1 {
		t.Errorf("reruns %+v, failures %+v; want %+v and the first run's failure", r.Reruns, r.Failures, want)
	}
	if _, err := r.Parse(marker + "rerun name=e2e.test status=1"); err == nil {
		t.Error("a rerun line without tests= parsed")
	}
}
