package vmtests

import (
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// The VM's /init reports on the serial console in lines that start with
// marker, followed by a kind and key=value fields:
//
//	@@vmtest boot kernel=6.1.0-40-cloud-amd64 uptime=6.02
//	@@vmtest suite name=bpf.test status=0 seconds=12.31
//	@@vmtest rerun name=e2e.test tests=TestA,TestB status=0
//	@@vmtest done status=0
//
// The runner trusts only these lines: no done line means the VM did not
// finish (a kernel panic, a hung suite, a timeout), and that is a failure.
const marker = "@@vmtest "

// BootLine is the first line /init prints: the running kernel and how long
// it took to get to /init.
func BootLine(kernel string, uptime time.Duration) string {
	return fmt.Sprintf("%sboot kernel=%s uptime=%.2f", marker, kernel, uptime.Seconds())
}

// SuiteLine reports one suite's exit status (128+signal if a signal ended it).
func SuiteLine(name string, status int, d time.Duration) string {
	return fmt.Sprintf("%ssuite name=%s status=%d seconds=%.2f", marker, name, status, d.Seconds())
}

// DoneLine is the last line: 0 if every suite passed.
func DoneLine(status int) string {
	return fmt.Sprintf("%sdone status=%d", marker, status)
}

// RerunLine reports that /init ran a suite's failed tests again, and how
// that ended. The suite's line that follows carries the final status.
func RerunLine(name string, tests []string, status int) string {
	return fmt.Sprintf("%srerun name=%s tests=%s status=%d", marker, name, strings.Join(tests, ","), status)
}

// MaxRerun is the most failed tests of a suite /init runs again: more
// than that is not a busy machine's flake but a broken build.
const MaxRerun = 3

// Reruns is how many times /init runs a suite's failed tests again, each
// time those that failed the time before.
const Reruns = 2

// RerunTests names the top-level tests to run again after a suite
// failed with these failures, or nil when a rerun would not tell anything:
// no test failed by name (a panic or a timeout ended the binary), or more
// than MaxRerun did.
func RerunTests(failures []Failure) []string {
	var tests []string
	for _, f := range failures {
		top, _, _ := strings.Cut(f.Test, "/")
		if !strings.HasPrefix(top, "Test") || strings.ContainsAny(top, " ()") {
			return nil
		}
		if !slices.Contains(tests, top) {
			tests = append(tests, top)
		}
	}
	if len(tests) == 0 || len(tests) > MaxRerun || len(failures) == maxFailures {
		return nil
	}
	return tests
}

// RunPattern is the -test.run pattern of exactly these top-level tests.
func RunPattern(tests []string) string {
	q := make([]string, len(tests))
	for i, t := range tests {
		q[i] = regexp.QuoteMeta(t)
	}
	return "^(" + strings.Join(q, "|") + ")$"
}

// Rerun is a suite's failed tests that /init ran again, once.
type Rerun struct {
	Suite  string
	Tests  []string
	Status int // the rerun's: 0 when every test passed the second time
}

// SuiteResult is one suite's outcome as reported by /init.
type SuiteResult struct {
	Name     string
	Status   int
	Duration time.Duration
}

// Report is what one VM's console said, gathered line by line with Parse.
type Report struct {
	Kernel string        // uname -r in the VM
	Boot   time.Duration // uptime when /init started
	Suites []SuiteResult
	Done   bool // the done line was seen
	Status int  // its status
	// Failures are the failed tests of the suites' go test -v output, in
	// the order their results were printed, at most maxFailures. The
	// summary repeats them: the end of a CI log is often all one sees.
	Failures []Failure
	// Reruns are the times /init ran a suite's failed tests again.
	Reruns []Rerun

	logged []string // test log lines since the last test started or ended
	before int      // len(Failures) when the current suite started
}

// Failure is one failed test and what was logged while it ran: the
// file:line lines and panics printed since the last test started, the last
// maxFailureLines of them, each cut to maxLineLen bytes.
type Failure struct {
	Test  string
	Lines []string
}

const (
	maxFailures     = 10
	maxFailureLines = 8
	maxLineLen      = 300
)

// testLog matches what t.Log and t.Error print: "    file.go:123: text".
var testLog = regexp.MustCompile(`^\s+[\w.-]+\.go:\d+: `)

// noteTestOutput follows go test -v output: a test's start or end clears
// the log lines gathered, a "--- FAIL:" takes them with it (the first of
// several nested results gets them: the subtest's lines are the parent's).
func (r *Report) noteTestOutput(line string) {
	s := strings.TrimLeft(line, " \t")
	switch {
	case strings.HasPrefix(s, "=== RUN"), strings.HasPrefix(s, "=== CONT"), strings.HasPrefix(s, "=== NAME"),
		strings.HasPrefix(s, "--- PASS:"), strings.HasPrefix(s, "--- SKIP:"):
		r.logged = r.logged[:0]
	case strings.HasPrefix(s, "--- FAIL:"):
		name, _, _ := strings.Cut(strings.TrimSpace(strings.TrimPrefix(s, "--- FAIL:")), " ")
		if len(r.Failures) < maxFailures {
			r.Failures = append(r.Failures, Failure{Test: name, Lines: slices.Clone(r.logged)})
		}
		r.logged = r.logged[:0]
	case testLog.MatchString(line), strings.HasPrefix(s, "panic:"):
		if len(s) > maxLineLen {
			s = s[:maxLineLen] + "..."
		}
		if len(r.logged) == maxFailureLines {
			r.logged = append(r.logged[:0], r.logged[1:]...)
		}
		r.logged = append(r.logged, s)
	}
}

// Passed reports whether the VM finished and every suite passed.
func (r *Report) Passed() bool {
	if !r.Done || r.Status != 0 {
		return false
	}
	for _, s := range r.Suites {
		if s.Status != 0 {
			return false
		}
	}
	return true
}

// Parse records line if it is a report line and says whether it was one.
// The marker may follow other output on the same line (a kernel message
// printed in the middle of a line, a carriage return). A malformed report
// line is an error.
func (r *Report) Parse(line string) (bool, error) {
	i := strings.Index(line, marker)
	if i < 0 {
		r.noteTestOutput(line)
		return false, nil
	}
	fields := strings.Fields(line[i+len(marker):])
	if len(fields) == 0 {
		return true, fmt.Errorf("report line %q: no kind", line)
	}
	kv := make(map[string]string, len(fields)-1)
	for _, f := range fields[1:] {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			return true, fmt.Errorf("report line %q: field %q is not key=value", line, f)
		}
		kv[k] = v
	}
	need := func(keys ...string) error {
		for _, k := range keys {
			if _, ok := kv[k]; !ok {
				return fmt.Errorf("report line %q: no %s=", line, k)
			}
		}
		return nil
	}
	seconds := func(k string) (time.Duration, error) {
		f, err := strconv.ParseFloat(kv[k], 64)
		if err != nil || f < 0 {
			return 0, fmt.Errorf("report line %q: %s=%q is not a number of seconds", line, k, kv[k])
		}
		return time.Duration(f * float64(time.Second)), nil
	}
	status := func() (int, error) {
		n, err := strconv.Atoi(kv["status"])
		if err != nil {
			return 0, fmt.Errorf("report line %q: status=%q is not an integer", line, kv["status"])
		}
		return n, nil
	}
	switch fields[0] {
	case "boot":
		if err := need("kernel", "uptime"); err != nil {
			return true, err
		}
		up, err := seconds("uptime")
		if err != nil {
			return true, err
		}
		r.Kernel, r.Boot = kv["kernel"], up
	case "suite":
		if err := need("name", "status", "seconds"); err != nil {
			return true, err
		}
		st, err := status()
		if err != nil {
			return true, err
		}
		d, err := seconds("seconds")
		if err != nil {
			return true, err
		}
		r.Suites = append(r.Suites, SuiteResult{Name: kv["name"], Status: st, Duration: d})
		// A suite that failed without a --- FAIL line (a panic, a test
		// binary's timeout) reports what it logged last.
		if st != 0 && len(r.Failures) == r.before && len(r.Failures) < maxFailures {
			r.Failures = append(r.Failures, Failure{Test: fmt.Sprintf("%s (exit %d)", kv["name"], st), Lines: slices.Clone(r.logged)})
		}
		r.before, r.logged = len(r.Failures), r.logged[:0]
	case "rerun":
		if err := need("name", "tests", "status"); err != nil {
			return true, err
		}
		st, err := status()
		if err != nil {
			return true, err
		}
		r.Reruns = append(r.Reruns, Rerun{Suite: kv["name"], Tests: strings.Split(kv["tests"], ","), Status: st})
	case "done":
		if err := need("status"); err != nil {
			return true, err
		}
		st, err := status()
		if err != nil {
			return true, err
		}
		r.Done, r.Status = true, st
	default:
		return true, fmt.Errorf("report line %q: unknown kind %q", line, fields[0])
	}
	return true, nil
}
